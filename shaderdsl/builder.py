"""ShaderM: the kernel builder, Python's mirror of Hesper's ``WGSL.Monad.ShaderM``.

Hesper threads a state (declarations, statements, a name counter) through a
Lean monad; here the same state lives in one ShaderM object and each method
call is one monadic action. Control flow uses ``with`` blocks. The builder
refuses what Hesper silently got wrong: it checks names, scopes and types,
and rejects an expression whose variables changed after it was built.
"""
from __future__ import annotations

import contextlib
import itertools
import sys

import numpy as np

from . import nodes as S
from . import types as T
from .context import type_error
from .errors import ShaderNameError, ShaderScopeError, is_positive_int
from .expr import (
    Call,
    Expr,
    Lit,
    Member,
    Ref,
    RefKind,
    as_expr,
    index,
    is_assignable,
    literal,
    next_seq,
    operands,
    reads,
    root,
    shaped_length,
)
from .location import caller_location, library_call
from .names import PREDECLARED, RESERVED, check_user_name
from .nodes import BUILTIN_VALUES
from .operators import SHIFT, binary_rule


class _Block:
    """What if_/elif_/else_/loop/while_ return: ``with`` opens the block (and
    gives the loop counter). Not entering it is a mistake the builder reports
    at the next statement or at the end of the build."""

    __slots__ = ("builder", "block", "loop", "value", "ctx", "frame", "vars")

    def __init__(self, builder, block, loop=False, value=None):
        self.builder, self.block, self.loop, self.value = builder, block, loop, value

    def __enter__(self):
        self.builder._pending = None
        self.ctx = self.builder._open(self.block, self.loop)
        self.ctx.__enter__()
        # the caller's names that hold a var now: a Python `=` to one of them inside
        # the block builds an expression and leaves the var unchanged in the WGSL
        self.frame = sys._getframe(1)
        self.vars = {k: v for k, v in self.frame.f_locals.items()
                     if isinstance(v, Ref) and v.kind == RefKind.VAR}
        return self.value

    def __exit__(self, *exc):
        frame, self.frame = self.frame, None
        assert frame is not None, "a block is left only after it was entered"
        if exc[0] is None:
            now = frame.f_locals
            for name, var in self.vars.items():
                new = now.get(name, var)
                if isinstance(new, Expr) and new is not var and not (
                        isinstance(new, Ref) and new.kind == RefKind.VAR):
                    self.ctx.__exit__(*exc)
                    raise ShaderScopeError(
                        f"{caller_location()}: `{name}` held the var `{var.name}` when this "
                        f"block opened and holds another expression now: a Python `=` does "
                        f"not change a var in the WGSL. Write `m.assign({name}, value)` "
                        f"inside the block")
        return self.ctx.__exit__(*exc)


def _given_type(t) -> str:
    """A type argument for a message; a numpy dtype or a type name gets a hint."""
    if isinstance(t, str) or isinstance(t, np.dtype) or \
            (isinstance(t, type) and issubclass(t, np.generic)):
        return (f"{t!r}: give a shaderdsl type (from shaderdsl import f32, vec4f, ...), "
                f"not a numpy dtype or a name")
    return repr(t) if not isinstance(t, T.WType) else str(t)


class ShaderM:
    """Accumulates declarations and statements of one compute kernel."""

    def __init__(self, workgroup_size: tuple[int, int, int], name: str = "kernel"):
        self.name = name
        self.workgroup_size = workgroup_size
        self.bindings: list[Ref] = []          # storage and uniform buffers, in binding order
        self.holds: dict[str, T.Scalar] = {}   # buffer name -> the values its host data holds
        self.overrides: list[tuple[Ref, object]] = []
        self.workgroup_vars: list[Ref] = []
        self.builtins: dict[str, Ref] = {}     # used builtin values, by DSL name
        self.features: set[str] = set()
        self.body = S.Block(0)
        self._blocks = [self.body]             # innermost last
        self.block_id = 0                      # id of the innermost open block (0: the body)
        self._block_ids = itertools.count(1)
        self._loop_depth = 0
        self._names: set[str] = set(BUILTIN_VALUES)
        self._fresh = itertools.count()
        self._version: dict[str, int] = {}     # mutable name -> times assigned
        self._uses: list[list] = []            # per open loop: (expression, its reads) used in it
        self._locals: dict[str, tuple] = {}    # local name -> (block id, where declared)
        self._pending = None                   # (where, what) of a block not yet entered
        self.functions: dict = {}              # @function -> its FunctionDef, callees first
        self.function_writes: dict = {}        # @function -> module-scope names it assigns
        self._in_function = None               # (name, builtins used) of a function being built

    # ------------------------------------------------------------ names

    def _declare_name(self, name: str | None, hint: str) -> str:
        if name is None:
            while True:
                name = f"_{hint}{next(self._fresh)}"
                if name not in self._names:
                    break
        else:
            why = check_user_name(name)
            if why:
                raise ShaderNameError(f"{caller_location()}: {why}")
            if name in self._names:
                raise ShaderNameError(f"{caller_location()}: the name {name!r} is already declared "
                                      f"in kernel {self.name!r}")
        self._names.add(name)
        return name

    def free_name(self, name: str) -> str:
        """``name``, or ``name_1``, ``name_2``... if it is taken: for library code
        (collectives) that declares module-scope arrays each time it is called."""
        base, k = name, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        return name

    def _local_name(self, name: str | None, hint: str) -> str:
        """Locals may reuse a hint: a taken name gets a numeric suffix, and one
        that is a WGSL keyword or predeclared name (``i32`` from ``f"i{k}"``)
        a trailing '_'. A local's name changes nothing but readability."""
        if name is not None and (name in RESERVED or name in PREDECLARED):
            name += "_"
        if name is not None and name in self._names and check_user_name(name) is None:
            base, k = name, 1
            while f"{base}_{k}" in self._names:
                k += 1
            name = f"{base}_{k}"
        return self._declare_name(name, hint)

    # ------------------------------------------------------------ declarations (module scope)

    def _buffer(self, name, elem, length, access, holds=None) -> Ref:
        if not isinstance(elem, T.WType) or isinstance(elem, T.Array):
            raise type_error(f"buffer element type must be a scalar, vector or atomic type, "
                             f"got {_given_type(elem)}")
        if elem == T.bool_ or T.scalar_of(elem) == T.bool_:
            raise type_error("bool is not host-shareable; store u32 instead")
        if isinstance(elem, T.Vector) and elem.size == 3:
            raise type_error(f"{elem} has a 16-byte stride in storage, which numpy arrays of 3 "
                             f"columns do not match; use vec4 (or 3 scalars)")
        if isinstance(elem, T.Atomic) and access != "read_write":
            raise type_error("atomic buffers must be declared with declare_output_buffer")
        if holds is not None and (holds not in (T.f16, T.f32) or T.scalar_of(elem) != T.u32):
            raise type_error(f"holds: a buffer of u32 (scalars or vectors) may hold f16 or f32 "
                             f"values (read through a u32 view), got {_given_type(elem)} "
                             f"holding {holds!r}")
        name = self._declare_name(name, "buf")
        length, shape = shaped_length(length, name)
        ref = Ref(name, T.array(elem, length), RefKind.BUFFER, access=access, shape=shape)
        self.bindings.append(ref)
        if holds is not None:
            self.holds[name] = holds
        return ref

    def declare_input_buffer(self, name: str, elem: T.WType, length=None,
                             holds: T.Scalar | None = None) -> Ref:
        """A storage buffer the kernel only reads: ``var<storage, read>``.
        ``length``: an element count, None (runtime-sized) or a shape such as
        ``(rows, cols)`` (ints, or u32 overrides and uniforms) for ``x[r, c]``.
        ``holds``: f16 or f32, the values the host's data holds where the
        kernel reads their bits through u32 elements (``bitcast``): a buffer of
        that dtype binds to it (16-byte reads of f16 as vec4<u32>)."""
        return self._buffer(name, elem, length, "read", holds)

    def declare_output_buffer(self, name: str, elem: T.WType, length=None) -> Ref:
        """A storage buffer the kernel may read and write: ``var<storage, read_write>``;
        ``length`` as for declare_input_buffer."""
        return self._buffer(name, elem, length, "read_write")

    def declare_uniform(self, name: str, type: T.WType) -> Ref:
        """A uniform buffer holding one scalar or vector: ``var<uniform>``."""
        if not isinstance(type, (T.Scalar, T.Vector)) or T.scalar_of(type) == T.bool_:
            raise type_error(f"a uniform must be a numeric scalar or vector, got "
                             f"{_given_type(type)}")
        name = self._declare_name(name, "uni")
        ref = Ref(name, type, RefKind.UNIFORM)
        self.bindings.append(ref)
        return ref

    def override(self, name: str, type: T.Scalar, default=None) -> Ref:
        """A pipeline-overridable constant, set per dispatch without new WGSL."""
        if not isinstance(type, T.Scalar):
            raise type_error(f"an override must be a scalar type, got {_given_type(type)}")
        name = self._declare_name(name, "ovr")
        if default is not None:
            default = literal(default, type)
        ref = Ref(name, type, RefKind.OVERRIDE)
        self.overrides.append((ref, default))
        return ref

    def shared(self, elem: T.WType, n, name: str | None = None) -> Ref:
        """A workgroup-shared array ``var<workgroup> name: array<elem, n>``;
        ``n`` an int or a shape of ints such as ``(16, 17)`` for ``tile[r, c]``."""
        if not isinstance(elem, T.WType):
            raise type_error(f"a workgroup array's element must be a scalar, vector, array or "
                             f"atomic type, got {_given_type(elem)}")
        shaped = isinstance(n, (tuple, list))
        dims = tuple(n) if shaped else (n,)
        if not all(is_positive_int(d) for d in dims):
            raise type_error(f"a workgroup array needs a positive int length or a shape of "
                             f"them, got {n!r}")
        name = self._declare_name(name, "wg")
        ref = Ref(name, T.array(elem, int(np.prod(dims))), RefKind.WORKGROUP,
                  shape=tuple(int(d) for d in dims) if shaped else None)
        self.workgroup_vars.append(ref)
        return ref

    def _builtin(self, key: str) -> Ref:
        if self._in_function is not None:
            # a function receives the builtin values it uses as extra parameters
            self._in_function[1].add(key)
            _, ty, feature = BUILTIN_VALUES[key]
            if feature:
                self.features.add(feature)
            return Ref(key, ty, RefKind.BUILTIN)
        if key not in self.builtins:
            _, ty, feature = BUILTIN_VALUES[key]
            if feature:
                self.features.add(feature)
            self.builtins[key] = Ref(key, ty, RefKind.BUILTIN)
        return self.builtins[key]

    def global_id(self) -> Ref: return self._builtin("global_id")
    def local_id(self) -> Ref: return self._builtin("local_id")
    def workgroup_id(self) -> Ref: return self._builtin("workgroup_id")
    def num_workgroups(self) -> Ref: return self._builtin("num_workgroups")
    def local_index(self) -> Ref: return self._builtin("local_index")
    def subgroup_invocation_id(self) -> Ref: return self._builtin("subgroup_invocation_id")
    def subgroup_size(self) -> Ref: return self._builtin("subgroup_size")

    # ------------------------------------------------------------ statements

    @property
    def _block(self) -> S.Block:
        return self._blocks[-1]

    def _emit(self, st) -> None:
        self.check_pending()
        self._block.stmts.append(st)

    def check_pending(self) -> None:
        """Refuse a block that was opened without ``with`` (its body would be empty)."""
        if self._pending is not None:
            where, what = self._pending
            self._pending = None
            raise ShaderScopeError(
                f"{where}: m.{what}(...) was called but its block was never entered; write "
                f"`with m.{what}(...):` and put the body inside it")

    def _block_of(self, what: str, block, loop=False, value=None) -> _Block:
        self._pending = (caller_location(), what)
        return _Block(self, block, loop, value)

    def check_use(self, e: Expr) -> Expr:
        """Refuse expressions that read out-of-scope locals or stale variables."""
        open_ids = {b.id for b in self._blocks}
        if self._in_function is not None:
            self._check_function_use(e, open_ids, self._in_function)
        if not e.blocks <= open_ids:
            raise ShaderScopeError(
                f"{caller_location()}: the expression built at {e.where} was built inside an "
                f"if_/loop block that has ended. If a Python `=` inside the block was meant "
                f"to update a var, write `m.assign(var, value)` there instead")
        deps = reads(e)
        for name, version, _ in deps:
            info = self._locals.get(name)
            if info is not None and info[0] not in open_ids:
                raise ShaderScopeError(
                    f"{caller_location()}: `{name}` was declared at {info[1]} inside a block "
                    f"that has ended; declare it before the block to use it here (if a "
                    f"Python `=` in the block rebound a var's name to it, write "
                    f"`m.assign(var, value)` there instead)")
            if self._version.get(name, 0) != version:
                raise ShaderScopeError(
                    f"{caller_location()}: the expression built at {e.where} reads `{name}`, "
                    f"which was assigned after the expression was built; bind it with "
                    f"m.let(...) where it should be read")
        if self._uses:
            self._uses[-1].append((e, deps))
        return e

    def _check_function_use(self, e: Expr, open_ids, function: tuple[str, set]) -> None:
        """A function body sees its parameters, its own locals and module-scope names
        (``function``: the name and builtins used of the function being built)."""
        stack = [e]
        while stack:
            x = stack.pop()
            stack.extend(operands(x))
            if not isinstance(x, Ref):
                continue
            if x.kind == RefKind.BUILTIN:
                function[1].add(x.name)
            local = self._locals.get(x.name)
            if local is not None and local[0] not in open_ids:
                raise ShaderScopeError(
                    f"{caller_location()}: function {function[0]!r} uses `{x.name}` "
                    f"of the kernel (declared at {local[1]}); a function sees only its "
                    f"parameters, builtin values and module-scope names: pass it as an argument")

    @contextlib.contextmanager
    def function_scope(self, name: str, body: S.Block):
        """Build a function's body: only its own block is open, no loop around it.
        Gives the set that collects the builtin values the body uses."""
        saved = (self._blocks, self._loop_depth, self._uses, self._in_function)
        self.check_pending()
        used: set = set()
        self._blocks, self._loop_depth, self._uses, self._in_function = [body], 0, [], (name, used)
        self.block_id = body.id
        try:
            yield used
            self.check_pending()
        finally:
            self._blocks, self._loop_depth, self._uses, self._in_function = saved
            self.block_id = self._blocks[-1].id

    def next_block(self) -> S.Block:
        return S.Block(next(self._block_ids))

    def param(self, name: str, type: T.WType, block: S.Block) -> Ref:
        """A function parameter: a let of the function's body block."""
        ref = Ref(self._local_name(name, "p"), type, RefKind.LET, block=block.id)
        self._locals[ref.name] = (block.id, caller_location())
        return ref

    def assigned_since(self, versions: dict) -> set:
        """Module-scope names assigned since ``versions`` (a copy of ``self.versions()``)."""
        return {n for n, v in self._version.items()
                if versions.get(n, 0) != v and n not in self._locals}

    def versions(self) -> dict:
        return dict(self._version)

    def call_function(self, fdef: S.FunctionDef, args: tuple, writes: set) -> Ref | None:
        """Emit a call of ``fdef`` (``args`` typed already); bind its result to a
        let. The names the function assigns change as a store would change them."""
        for a in args:
            self.check_use(a)
        for key in fdef.builtins:
            # the caller has it: the entry point declares it, a function takes it
            self._builtin(key)
        ref = None
        if fdef.result is not None:
            ref = Ref(self._local_name(fdef.name + "_r", "r"), fdef.result.type, RefKind.LET,
                      block=self.block_id)
            self._locals[ref.name] = (self.block_id, caller_location())
        self._emit(S.CallFunction(fdef, args, ref, caller_location()))
        for name in writes:
            self._version[name] = self._version.get(name, 0) + 1
        return ref

    def _bump(self, target: Expr) -> None:
        named = root(target)
        assert isinstance(named, Ref), "an assignable target starts from a name"
        self._version[named.name] = self._version.get(named.name, 0) + 1

    def let(self, value, name: str | None = None) -> Ref:
        """``let name = value;``: an immutable snapshot; returns its name."""
        value = self.check_use(as_expr(value))
        if isinstance(value.type, T.Atomic):
            raise type_error("cannot bind an atomic with let; use atomic_load(...)")
        name = self._local_name(name, "t")
        ref = Ref(name, value.type, RefKind.LET, block=self._block.id)
        self._locals[name] = (self._block.id, caller_location())
        self._emit(S.Let(ref, value, caller_location()))
        return ref

    def var(self, type, init=None, name: str | None = None) -> Ref:
        """``var name: type = init;``. ``m.var(expr)`` infers the type from ``expr``."""
        if not isinstance(type, T.WType):
            type, init = None, type
        if init is not None:
            init = self.check_use(as_expr(init, type))
            if type is None:
                type = init.type
            elif init.type != type:
                raise type_error(f"var of type {type} initialised with {init.type}")
        if isinstance(type, T.Array) and type.length is None:
            raise type_error("a function-scope var needs a fixed-size array")
        elem = type.elem if isinstance(type, T.Array) else type
        if isinstance(elem, T.Atomic):
            raise type_error("atomics live in storage or workgroup memory: use "
                             "declare_output_buffer(..., atomic(u32)) or m.shared(atomic(u32), n)")
        name = self._local_name(name, "v")
        ref = Ref(name, type, RefKind.VAR, block=self._block.id)
        self._locals[name] = (self._block.id, caller_location())
        self._emit(S.VarDecl(ref, init, caller_location()))
        return ref

    def assign(self, target: Expr, value, op: str = "") -> None:
        """``target = value`` (or ``target op= value``); also what ``buf[i] = v`` calls."""
        if not isinstance(target, Expr) or not is_assignable(target):
            r = root(target) if isinstance(target, Expr) else None
            if isinstance(r, Ref) and r.kind == RefKind.BUFFER:
                raise type_error(f"buffer `{r.name}` is read-only (declared with "
                                 f"declare_input_buffer); declare it with declare_output_buffer "
                                 f"to write it")
            what = f"`{r.name}` ({r.kind})" if isinstance(r, Ref) else "this expression"
            raise type_error(f"cannot assign to {what}")
        if isinstance(target.type, T.Atomic):
            raise type_error("cannot assign to an atomic; use atomic_store(...) or atomic_add(...)")
        if isinstance(target, Member) and len(target.name) > 1:
            raise type_error(f"WGSL cannot assign to a swizzle ({target.name!r}); assign one "
                             f"component at a time or the whole vector")
        value = as_expr(value, T.u32 if op in SHIFT else target.type)
        if op:
            op, _ = binary_rule(op, target, value)  # the type check of `target op value`
        elif value.type != target.type:
            raise type_error(f"cannot assign {value.type} to a {target.type} location")
        self.check_use(target)
        self.check_use(value)
        self._emit(S.Assign(target, value, op or None, caller_location()))
        self._bump(target)

    def store(self, buffer: Expr, i, value) -> None:
        """``buffer[index] = value`` (Hesper's ``writeBuffer``)."""
        self.assign(index(buffer, i), value)

    def effect(self, call: Call) -> Ref | None:
        """Emit a side-effecting call now; bind its result to a let if it has one."""
        self.check_use(call)
        target = call.args[0].target
        ref = None
        if call.type is not None:
            name = self._local_name(None, "t")
            ref = Ref(name, call.type, RefKind.LET, block=self._block.id)
            self._locals[name] = (self._block.id, caller_location())
        self._emit(S.Effect(call, ref, caller_location()))
        self._bump(target)
        return ref

    def comment(self, text: str) -> None:
        """A ``// text`` line in the generated WGSL."""
        self._emit(S.Comment(str(text).replace("\n", " "), caller_location()))

    # ------------------------------------------------------------ control flow

    @contextlib.contextmanager
    def _open(self, block: S.Block, loop: bool = False):
        self._blocks.append(block)
        self.block_id = block.id
        if loop:
            self._loop_depth += 1
            self._uses.append([])
            start = dict(self._version), next_seq()
        try:
            yield
        finally:
            self._blocks.pop()
            self.block_id = self._blocks[-1].id
            if loop:
                self._loop_depth -= 1
                uses = self._uses.pop()
                self._check_loop(uses, *start)
                if self._uses:
                    self._uses[-1].extend(uses)

    def _check_loop(self, uses, versions_before, seq_before) -> None:
        """An expression built before a loop that reads a name the loop assigns
        would see a different value on the next iteration: refuse it."""
        changed = {n for n, v in self._version.items() if versions_before.get(n, 0) != v}
        for e, deps in uses:
            for name, _, seq in deps:
                if name in changed and seq < seq_before:
                    raise ShaderScopeError(
                        f"{e.where}: this expression was built before a loop and reads "
                        f"`{name}`, which the loop assigns; build it inside the loop or bind "
                        f"it with m.let(...) before the loop")

    def _cond(self, cond) -> Expr:
        c = self.check_use(as_expr(cond, T.bool_))
        if c.type != T.bool_:
            raise type_error(f"a condition must be bool, got {c.type}")
        return c

    def if_(self, cond):
        """``with m.if_(cond):`` opens the then-block."""
        block = S.Block(next(self._block_ids))
        self._emit(S.If([(self._cond(cond), block)], None, caller_location()))
        return self._block_of("if_", block)

    def _open_if(self, what: str) -> S.If:
        self.check_pending()
        last = self._block.stmts[-1] if self._block.stmts else None
        if not isinstance(last, S.If) or last.else_body is not None:
            raise ShaderScopeError(f"{caller_location()}: {what} must directly follow "
                                   f"an `if_` or `elif_` block")
        return last

    def elif_(self, cond):
        """``with m.elif_(cond):`` right after an if_/elif_ block."""
        st = self._open_if("elif_")
        block = S.Block(next(self._block_ids))
        st.branches.append((self._cond(cond), block))
        return self._block_of("elif_", block)

    def else_(self):
        """``with m.else_():`` right after an if_/elif_ block."""
        st = self._open_if("else_")
        st.else_body = S.Block(next(self._block_ids))
        st.else_where = caller_location()
        return self._block_of("else_", st.else_body)

    def loop(self, start, end=None, step=1, name: str | None = None):
        """``with m.loop(start, end, step) as i:`` a runtime for loop.

        ``m.loop(n)`` counts 0..n-1. The counter is u32 unless start/end are
        typed otherwise. A negative Python ``step`` counts down (``i > end``).
        """
        if end is None:
            start, end = 0, start
        like = next((x.type for x in (start, end, step) if isinstance(x, Expr)), T.u32)
        descending = isinstance(step, (int, float)) and step < 0
        if descending:
            step = -step
        start, end, step = (as_expr(x, like) for x in (start, end, step))
        ty = start.type
        if not (isinstance(ty, T.Scalar) and ty.is_int) or end.type != ty or step.type != ty:
            raise type_error(f"loop bounds must share one integer type, got "
                             f"{start.type}, {end.type}, {step.type}")
        for x in (start, end, step):
            self.check_use(x)
        if isinstance(step, Lit) and step.value == 0:
            raise type_error("a loop step of 0 never ends; give a step of 1 or more "
                             "(a negative Python int counts down)")
        body = S.Block(next(self._block_ids))
        vname = self._local_name(name or None, "i")
        ref = Ref(vname, ty, RefKind.LOOP, block=body.id)
        self._locals[vname] = (body.id, caller_location())
        self._emit(S.For(ref, start, end, step, descending, body, caller_location()))
        return self._block_of("loop", body, loop=True, value=ref)

    def while_(self, cond):
        """``with m.while_(cond):`` loops while ``cond`` (re-read each iteration) holds."""
        c = as_expr(cond, T.bool_)
        if c.type != T.bool_:
            raise type_error(f"a condition must be bool, got {c.type}")
        self.check_use(c)
        body = S.Block(next(self._block_ids))
        self._emit(S.While(c, body, caller_location()))
        return self._block_of("while_", body, loop=True)

    def static_loop(self, iterable):
        """A loop unrolled in Python: the body is emitted once per item."""
        return iter(iterable)

    def _jump(self, kind: S.JumpKind) -> None:
        if kind != S.JumpKind.RETURN and self._loop_depth == 0:
            raise ShaderScopeError(f"{caller_location()}: `{kind}` outside a loop")
        if kind == S.JumpKind.RETURN and self._in_function is not None:
            raise ShaderScopeError(f"{caller_location()}: m.return_() inside function "
                                   f"{self._in_function[0]!r}: a function returns the value its "
                                   f"Python function returns, at its end")
        self._emit(S.Jump(kind, caller_location()))

    def break_(self) -> None:
        self._jump(S.JumpKind.BREAK)

    def continue_(self) -> None:
        self._jump(S.JumpKind.CONTINUE)

    def return_(self) -> None:
        self._jump(S.JumpKind.RETURN)

    def barrier(self) -> None:
        """``workgroupBarrier()``: workgroup memory writes before are visible after."""
        self._emit(S.Barrier(S.BarrierKind.WORKGROUP, caller_location(), library_call()))

    def storage_barrier(self) -> None:
        """``storageBarrier()``: storage writes of this workgroup are visible after."""
        self._emit(S.Barrier(S.BarrierKind.STORAGE, caller_location(), library_call()))

    # ------------------------------------------------------------ versions for Expr deps

    def version(self, name: str) -> int:
        return self._version.get(name, 0)

    # ------------------------------------------------------------ result

    def module(self) -> S.Module:
        """The kernel built so far, as the tree the emitter and interpreter read."""
        self.check_pending()
        return S.Module(self.name, self.workgroup_size, tuple(self.bindings),
                        tuple(self.overrides), tuple(self.workgroup_vars), dict(self.builtins),
                        frozenset(self.features), self.body, tuple(self.functions.values()),
                        dict(self.holds))
