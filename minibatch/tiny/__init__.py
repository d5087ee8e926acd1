"""The embedded default model ``tiny``: its procedural corpus and its training script.

- :mod:`.corpus`: short stories and chats in English and Chinese, generated from templates
  (standard library only);
- :mod:`.train`: ``python -m minibatch.tiny.train`` trains the tokenizer and the
  4M-parameter Llama whose weights ship in ``minibatch/assets/tiny``.
"""
