"""Ship a model (pruned by gatedprune, or any dense Hugging Face seq2seq model) to the runtimes it is served with.

One module per format, each a row of ``formats.FORMATS``: ``ct2`` (CTranslate2), ``onnx`` (ONNX Runtime) and
``hf-portable`` (the stock transformers class, no ``trust_remote_code``). Every format reads the PyTorch model,
writes its files into a staged directory, and checks there that its runtime gives the PyTorch model's greedy
tokens before the directory appears (``verify``). Nothing here decides what goes or cuts: it converts what surgery
made.
"""
