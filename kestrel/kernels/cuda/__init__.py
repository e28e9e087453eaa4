"""CUDA C++ kernels compiled by NVRTC at first use (kestrel/kernels/cuda/cuda_rtc.py) and launched through the driver API."""
