"""vlm-catalog: structured product metadata from images and text with Qwen3-VL-MoE models."""

__version__ = "0.1.0"
