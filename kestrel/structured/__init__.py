"""Constrained decoding (structured outputs) through xgrammar: a StructuredOutput becomes a grammar
(grammar.py, tokenizer-free: what the server validates), a compiled grammar over the model's vocabulary
(compiler.py, cached) and, per sequence, a matcher that says which tokens may come next (matcher.py)."""
