"""Speculative decoding: the configuration, the proposers (EAGLE-3, n-gram) and the lossless verifier."""
