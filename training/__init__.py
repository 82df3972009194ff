"""Code that trains mtpkit's embedded models. Not part of the installed library: it imports
transformers (a test and training dependency only). Run it from a source checkout, e.g.
`python examples/train_tiny.py`."""
