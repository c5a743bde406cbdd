"""Checkpoints as the notebook kernel sees them: their format, what they hold, export to one file.

Torch-free to import; the engines' side (save, load) lives in `mpnb.engine.checkpoint`.
"""
