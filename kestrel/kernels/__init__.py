"""The kernels, each beside its torch reference: Triton (triton/) and CUDA C++ compiled by NVRTC (cuda/)."""
