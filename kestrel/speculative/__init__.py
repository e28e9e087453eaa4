"""Speculative decoding: the proposers (EAGLE-3, n-gram), the depth policy and the lossless verifier. Its
configuration is kestrel/speculative_config.py; the drafter's CUDA graphs are runner machinery (forward/)."""
