"""The applications built on blobfeed: the ``blobfeed`` command (``cli``),
``blobfeed demo`` (``demo``), ``blobfeed bench`` (``bench``) and the small
ONNX models of the examples and tests (``models``).

The library never imports them, and they use only its public modules
(``blobfeed``, ``blobfeed.metrics``, ``blobfeed.ray``): they are users of
blobfeed like any other (tests/test_layers.py holds both rules).
"""
