"""Hugging Face interop: import HF model directories (``--init-from DIR``), export to them (``--format hf``).

``config`` maps config.json <-> ModelSpec (no torch), ``convert`` maps parameter names and layouts,
``load`` reads a directory per stage, ``export`` writes one atomically, ``publish`` adds what a published
model carries besides the weights (dtype, token ids, generation config, tokenizer).
"""
