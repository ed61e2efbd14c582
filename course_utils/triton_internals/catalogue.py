"""Every Triton internal the course relies on (:mod:`course_utils.triton_internals`), with the Triton version it
was read from and the assumption it makes; ``triton_internals.problems`` checks each against the installed Triton.
Plain data: nothing here imports Triton."""

from __future__ import annotations

from dataclasses import dataclass

WRITTEN_FOR = (3, 6)  # the Triton (major, minor) every internal below was read from and tested on


@dataclass(frozen=True)
class Internal:
    name: str
    written_for: tuple[int, int]
    assumption: str
    used_by: str


INTERNALS = {i.name: i for i in (
    Internal("JITFunction.run", WRITTEN_FOR,
             "triton.runtime.jit.JITFunction.run(self, *args, grid, warmup, **kwargs) is what kernel[grid](...) "
             "calls; a JITFunction has .fn, .params (KernelParams with .name, .is_constexpr, .has_default, "
             ".default), .signature, .arg_names, .debug and .pre_run_hooks",
             "aot.pretend (records launches), profile.triton_launch_hook (counts them), tuned.launch (the fast "
             "launch: launch_method, launch_parameters and pre_run_hooks)"),
    Internal("Autotuner.run", WRITTEN_FOR,
             "triton.runtime.autotuner.Autotuner has .run(*args, **kwargs), .configs (triton.Config with "
             ".all_kwargs()) and .fn, the wrapped kernel", "aot.pretend (records every config)"),
    Internal("InterpretedFunction", WRITTEN_FOR,
             "under TRITON_INTERPRET=1 @triton.jit makes triton.runtime.interpreter.InterpretedFunction, "
             "whose .run(*args, grid, warmup, **kwargs) runs the kernel", "profile, aot (refuses them)"),
    Internal("create_function_from_signature", WRITTEN_FOR,
             "triton.runtime.jit.create_function_from_signature(sig, kparams, backend) returns the binder "
             "JITFunction.run uses: binder(*args, **kwargs) -> (bound_args, specialization, options)",
             "aot (binding a recorded launch for a target GPU)"),
    Internal("JITFunction._pack_args", WRITTEN_FOR,
             "JITFunction._pack_args(backend, kwargs, bound_args, specialization, options) -> "
             "(options, signature, constexprs, attrs), as JITFunction.run calls it before compiling",
             "aot (binding a recorded launch for a target GPU)"),
    Internal("CompiledKernel.__getitem__", WRITTEN_FOR,
             "kernel[grid](...) (JITFunction.run) returns the triton.compiler.CompiledKernel it launched, and "
             "compiled[grid](*args) launches it again, args being every parameter in signature order, constexprs "
             "included (JITFunction.run passes *bound_args.values() to CompiledKernel.run)",
             "tuned.launch (the course ops' cached launches)"),
    Internal("knobs", WRITTEN_FOR,
             "triton.knobs.runtime.debug and triton.knobs.compilation.instrumentation_mode exist: "
             "JITFunction.run adds them to the launch's keyword arguments; knobs.runtime.launch_enter_hook is None "
             "or a HookChain with .calls", "aot, tuned.launch (hook check, cache key)"),
    Internal("compiler", WRITTEN_FOR,
             "triton.compiler exports ASTSource(fn, signature, constexprs, attrs) and make_backend(target); "
             "triton.backends.compiler exports GPUTarget(backend, arch, warp_size); triton.compile(src, "
             "target=, options=) returns a kernel with .asm['ptx'/'cubin'] and .metadata.shared",
             "aot (compiling for sm_75/80/90 on a machine without a GPU)"),
    Internal("InterpreterBuilder.create_masked_load", WRITTEN_FOR,
             "under the interpreter every tl.load calls triton.runtime.interpreter.InterpreterBuilder."
             "create_masked_load(self, ptrs, mask, ...) (the rest passed through: Triton 3.9 renamed them); "
             "ptrs.data and mask.data are NumPy arrays, ptrs.get_element_ty().primitive_bitwidth the element bits",
             "interpreter_load_hook (checkers: loads outside the inputs, passes over a row)"),
    Internal("InterpreterBuilder.set_grid_idx", WRITTEN_FOR,
             "under the interpreter a launch calls InterpreterBuilder.set_grid_dim(self, nx, ny, nz) once, then "
             "set_grid_idx(self, x, y, z) before each program (it refuses x >= grid_dim[0]); tl.program_id "
             "reads builder.grid_idx",
             "interpreter_programs_from (checkers: the last programs of a grid past 2**31 elements)"),
    Internal("interpreter._patch_lang_tensor", WRITTEN_FOR,
             "triton.runtime.interpreter._patch_lang_tensor(tensor, scope) installs the methods of "
             "tl.tensor under the interpreter (scope.set_attr(tensor, name, fn)); its __index__ calls "
             "int(array), which NumPy >= 2.4 refuses for 1-element arrays of rank 1",
             "patch_interpreter_index (env.py, interpreter mode: `for i in range(0, n, BLOCK)`)"),
)}
