"""Compute backends: ``torch`` (the reference, CPU or CUDA; its matmul kernels in
``torch_linear.py``), ``triton`` (Triton kernels for CUDA, or Triton's interpreter on a CPU)
and ``conformance.py``, the kit a third-party backend is checked with
(``tokenloom.testing.check_backend``)."""
