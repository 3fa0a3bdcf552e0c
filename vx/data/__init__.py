"""Inputs to samples: dataset sources and formats, chat templates and loss masks, the tokenizer and
model resolution, layer ids, and the embedded default model."""
