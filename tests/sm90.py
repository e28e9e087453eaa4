"""Compiling a Triton kernel for the H100/H200 (sm_90) on a machine with no GPU: Triton's own ptxas turns the PTX
into a cubin, so a kernel that cannot build for Hopper fails here, before any device time is spent."""
from __future__ import annotations


def compile_for_sm90(fn, constexprs: dict, types: dict[str, str], options: dict | None = None) -> str:
    """PTX of `fn` for sm_90 (with the launch's compile `options`, e.g. enable_fp_fusion). Arguments not in
    `constexprs` take their type from `types` by name, else by suffix: *_ptr '*bf16', anything else 'i32'."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
