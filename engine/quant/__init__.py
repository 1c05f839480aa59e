"""Quantized weights: formats (engine/quant/formats.py), modules, quantize-on-load, the eval harness."""
