"""Models written as DeepSpeed LayerSpecs: the reference GPT (``gpt``) and Hugging Face causal LMs (``hf``, needs
the ``hf`` extra: ``pip install -e '.[hf]'``)."""
