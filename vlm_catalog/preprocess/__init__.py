"""Image and text preprocessing: Qwen-VL smart resize, patches, chat prompt, MRoPE positions."""
