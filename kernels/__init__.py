"""vlmprune kernels: C++/CUDA sources behind one C ABI (include/vlmprune/kernels.h).

cpu/ and cuda/ implement the pruning semantics of shared/DESIGN.md, ort/ wraps the CPU
kernels as the ONNX Runtime custom ops of domain "vlmprune", trt/ as TensorRT plugins.
`vlmprune.kernels.build` compiles them on demand (build_ort_library, nvcc_compile).
"""
