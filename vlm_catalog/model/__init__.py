"""Qwen3-VL-MoE model code for serving: vision tower, MoE decoder, checkpoint loading."""
