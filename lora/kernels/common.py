"""Building blocks shared by the LoRA kernels: buffers, f16 handling, reductions, loops.

``dtype`` is the storage type of A, B, x and output: "f32", or "f16" (needs
the adapter's shader-f16). Arithmetic is f32 either way: every f16 load is
widened, and only a final store to f16 storage rounds (except where a
kernel asks for ``half``: products of A and x summed in f16, half_dot).
Loops over rank are unrolled in Python, so each accumulator is its own WGSL
variable and stays in a register under both naga and Tint. Rows are read as
vec4 when their length is a multiple of 4.
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import collectives, f16, f32, u32, vec4f, vec4h

SHARED_FLOATS = 4096  # 16 KiB: the WebGPU default maxComputeWorkgroupStorageSize


def check_threads(threads: int) -> None:
    """The reductions halve the workgroup: its size must be a power of two."""
    if not isinstance(threads, int) or threads < 1 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two, got {threads!r}")


def width(n: int) -> int:
    """Vector width for rows of length n: vec4 when it divides, else scalar."""
    return 4 if n % 4 == 0 else 1


DTYPES = ("f32", "f16")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def input_matrix(m, name, n_rows, row_len, dtype="f32"):
    """Declare a read-only row-major matrix; returns (buffer, elements per row).
    ``n_rows`` None: as many rows as the bound buffer holds (runtime-sized)."""
    check_dtype(dtype)
    w = width(row_len)
    elem = {("f32", 4): vec4f, ("f32", 1): f32, ("f16", 4): vec4h, ("f16", 1): f16}[dtype, w]
    return m.declare_input_buffer(name, elem, token_rows(n_rows, row_len // w)), row_len // w


# ------------------------------------------------------------- tiles staged in workgroup memory

def hold(m, items, threads, value, name="", into=None):
    """This thread's share (items j = local_index + k threads) of ``items``
    vec4 items, item j being ``value(j)`` (j clamped to the last item): loaded
    into new vars named ``name``, or assigned to ``into``'s. Loaded before
    the arithmetic of a step and stored (``stage``) after it, a tile's reads
    overlap that arithmetic."""
    out = into or []
    for k in range(-(-items // threads)):
        v = value(B.min(m.local_index() + k * threads, items - 1))
        if into is None:
            out.append(m.var(vec4f, v, f"{name}{k}"))
        else:
            m.assign(into[k], v)
    return out


def stage(m, shared, items, held, threads):
    """shared[j] = the item j this thread holds (from ``hold``)."""
    for k, value in enumerate(held):
        j = m.let(m.local_index() + k * threads, "j")
        if (k + 1) * threads > items:
            with m.if_(j < items):
                shared[j] = value
        else:
            shared[j] = value


def _stage_items(rows, chunk, threads):
    """(work items, per thread) of staging a rows x chunk tile: an item is one
    vec4 of 4 consecutive rows."""
    items = rows // 4 * (chunk // 4)
    return items, -(-items // threads)


def stage_load(m, src, rows, chunk, in_n, step, row_of, threads, name="", into=None):
    """Load this thread's items of step ``step`` of a rows x chunk tile of src
    (4 vec4 each; row r at ``row_of(r)``, or at r where row_of is None) into
    vars (new ones named ``name``, or ``into``); returns them."""
    items, per_thread = _stage_items(rows, chunk, threads)
    out = into or []
    for it in range(per_thread):
        j = B.min(m.local_index() + it * threads, items - 1)
        rq, kq = j / (chunk // 4), j % (chunk // 4)
        rows = [rq * 4 + c if row_of is None else row_of(rq * 4 + c) for c in range(4)]
        vals = [widen(src[row * in_n + step * (chunk // 4) + kq]) for row in rows]
        if into is None:
            out.append([m.var(vec4f, v, f"{name}{it}_{c}") for c, v in enumerate(vals)])
        else:
            for var, v in zip(into[it], vals):
                m.assign(var, v)
    return out


def stage_store(m, shared, rows, chunk, held, threads):
    """shared[k, r / 4] = (row r + c's column k, for c < 4): the 4 x 4 transpose
    of each item this thread holds (from ``stage_load``)."""
    items, per_thread = _stage_items(rows, chunk, threads)
    for it in range(per_thread):
        j = m.let(m.local_index() + it * threads, "j")

        def store():
            rq, kq = j / (chunk // 4), j % (chunk // 4)
            for c in range(4):
                shared[(kq * 4 + c) * (rows // 4) + rq] = vec4f(
                    *[getattr(v, "xyzw"[c]) for v in held[it]])
        if (it + 1) * threads > items:
            with m.if_(j < items):
                store()
        else:
            store()


class TransposedTile:
    """A rows x chunk tile of src per step, staged transposed in ``shared`` (a
    vec4 holds 4 rows): ``load`` before a step's arithmetic, ``store`` after."""

    def __init__(self, m, shared, src, rows, chunk, in_n, row_of, threads):
        self.m, self.shared, self.src, self.threads = m, shared, src, threads
        self.rows, self.chunk, self.in_n, self.row_of = rows, chunk, in_n, row_of

    def load(self, step, name="", into=None):
        return stage_load(self.m, self.src, self.rows, self.chunk, self.in_n, step, self.row_of,
                          self.threads, name, into)

    def store(self, held):
        stage_store(self.m, self.shared, self.rows, self.chunk, held, self.threads)


class DirectTile:
    """``items`` consecutive vec4s of src per step, staged in ``shared`` as stored."""

    def __init__(self, m, shared, src, items, threads):
        self.m, self.shared, self.src, self.items, self.threads = m, shared, src, items, threads

    def load(self, step, name="", into=None):
        def item(j):
            return widen(self.src[step * self.items + j])
        return hold(self.m, self.items, self.threads, item, name, into)

    def store(self, held):
        stage(self.m, self.shared, self.items, held, self.threads)


# ------------------------------------------------------------------ the token count

def columns_of(width: int, stride: int, column: int) -> tuple[int, int]:
    """(row stride, first column) of a block of ``width`` columns inside rows
    of ``stride`` values (0: the block is the whole row), checked: how a
    product writes or reads one slice of a wider matrix (a language model's
    logits, one chunk of the vocabulary per binding of its head)."""
    stride = stride or width
    if column < 0 or column + width > stride:
        raise ValueError(f"columns {column}..{column + width - 1} do not fit rows of {stride}")
    return stride, column


def token_rows(tokens, row_len: int):
    """Elements of ``tokens`` rows of ``row_len``; None (runtime-sized) for a
    token count read at run time."""
    return None if tokens is None else tokens * row_len


def token_count(m, tokens):
    """The token count as the kernel uses it: the int ``tokens`` baked into the
    WGSL, or, for ``tokens=None``, the u32 uniform ``tokens``, one value per
    dispatch (a Plan passes ``np.uint32(T)``; every T then shares one pipeline),
    declared on the first call and the same uniform after."""
    if tokens is not None:
        return tokens
    declared = [ref for ref in m.bindings if ref.name == "tokens"]
    return declared[0] if declared else m.declare_uniform("tokens", u32)


def split_index(m, axis: str, name: str):
    """Workgroup index along ``axis`` ("x" or "y") of a grid whose count on that
    axis may exceed max-compute-workgroups-per-dimension: a run-time Plan then
    splits it over z (``lora.plan.split_grid``), and the index is
    ``workgroup_id.axis + workgroup_id.z * num_workgroups.axis``."""
    wid = m.workgroup_id()
    return m.let(getattr(wid, axis) + wid.z * getattr(m.num_workgroups(), axis), name)


def past_the_end(m, index, count) -> None:
    """Workgroups of a split grid beyond the last row return at once (a
    condition uniform over the workgroup, so later barriers stay legal)."""
    with m.if_(index >= count):
        m.return_()


def workgroup_token(m, tokens, axis):
    """The token of this workgroup, ``workgroup_id.axis``; at run time (tokens
    None) also over z, and the workgroups past the last token return."""
    if tokens is not None:
        return getattr(m.workgroup_id(), axis)
    t = split_index(m, axis, "t")
    past_the_end(m, t, token_count(m, tokens))
    return t


def tile_origin(m, tokens, tile_tokens):
    """(token count, first token t0 of this workgroup's tile); at run time the
    tiles come from workgroup_id.x and .z, and those past the last token return."""
    if tokens is None:
        n = token_count(m, tokens)
        t0 = m.let(split_index(m, "x", "tile") * tile_tokens, "t0")
        past_the_end(m, t0, n)
        return n, t0
    return tokens, m.let(m.workgroup_id().x * tile_tokens, "t0")


def storage_scalar(dtype: str):
    check_dtype(dtype)
    return f16 if dtype == "f16" else f32


def output_buffer(m, n, dtype, name="output", quad=False):
    """The output, read and written as ``dtype`` scalars, or as vec4 with ``quad``
    (n scalars either way; None: runtime-sized)."""
    if not quad:
        return m.declare_output_buffer(name, storage_scalar(dtype), n)
    return m.declare_output_buffer(name, vec4h if dtype == "f16" else vec4f,
                                   None if n is None else n // 4)


def widen(e):
    """An f16 (or vec4<f16>) value widened to f32; f32 values unchanged."""
    if e.type == f16:
        return f32(e)
    if e.type == vec4h:
        return vec4f(e)
    return e


def store_output(out, i, value):
    """out[i] = value (f32 or vec4<f32>), rounded to f16 when out holds f16."""
    elem = out.type.elem
    out[i] = elem(value) if elem in (f16, vec4h) else value


def dot_or_mul(a, b):
    return B.dot(a, b) if a.type == vec4f else a * b


def as_stored(e):
    """e unchanged (the f16 kept as f16 for half_dot)."""
    return e


def half_dot(a, b):
    """a . b (vec4<f16>) or a * b (f16) computed in f16, widened to f32."""
    if a.type not in (f16, vec4h):
        raise ValueError(f"half products need f16 storage of A and x, got {a.type}")
    return f32(B.dot(a, b) if a.type == vec4h else a * b)


def reduce_sum(m, accs, threads, subgroups):
    """Sum each accumulator over the workgroup (shaderdsl.collectives.reduce);
    returns lets h0, h1, ... holding the sums.

    With subgroups: one subgroupAdd per value, one slot per subgroup in
    workgroup memory, then each subgroup adds the slots (1 barrier). Without: a tree in
    workgroup memory, in groups of values that fit 16 KiB (log2(threads) + 2
    barriers per group).
    """
    check_threads(threads)
    return collectives.reduce(m, list(accs), "sum", subgroups=subgroups,
                              names=[f"h{r}" for r in range(len(accs))])


def tree_sum(m, accs, threads, lanes, lane, finish, floats=SHARED_FLOATS):
    """Sum each accumulator over groups of ``lanes`` consecutive threads
    (shaderdsl.collectives.tree); ``finish(red, chunk, g0)`` reads the sums."""
    collectives.tree(m, list(accs), "sum", lanes, lane, finish, floats)


UNROLL_BUDGET = 256  # statements a loop may unroll into in Python; beyond, a runtime loop


def unrolled_or_loop(m, start, stop, stride, per_iteration, body, name, unroll=True):
    """``for c in range(start, stop, stride): body(c)``: unrolled in Python while
    it stays under UNROLL_BUDGET statements (every load issued up front), else
    (or with ``unroll=False``) a runtime loop. ``start`` is a shader
    expression, ``stop`` and ``stride`` ints. Tint profits from unrolling;
    naga's output can run slower unrolled, so the autotuner tries both."""
    iterations = -(-stop // stride)
    if unroll and iterations * per_iteration <= UNROLL_BUDGET:
        for j in range(iterations):
            c = m.let(start + j * stride, f"{name}{j}")
            if (j + 1) * stride > stop:
                with m.if_(c < stop):
                    body(c)
            else:
                body(c)
    else:
        with m.loop(start, stop, stride, name=name) as c:
            body(c)


def partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll=True, rows=None, half=False):
    """Each lane's partial sums of A[r] . x[t] over columns lane, lane + lanes, ...
    for r < rank; ``rows``: the start of each row in A (default r * in_n).
    ``t`` is one token (returns one accumulator per rank) or a list of tokens
    (returns a list per token): each load of A then serves every token.
    ``half`` (f16 storage): each vec4 product of A and x is summed in f16 and
    only that sum widened and added to the f32 accumulator, so no element of
    A is converted; four products and three sums rounded to f16 bound h's error
    by 2**-9 of |A| @ |x|, beyond the f32 sums' bound where terms cancel.

    With few iterations the loop is unrolled in Python, so every load is
    issued before the first multiply waits on memory.
    """
    ts = t if isinstance(t, list) else [t]
    tag = [""] if len(ts) == 1 else [f"{j}_" for j in range(len(ts))]
    accs = [[m.var(f32, 0.0, f"acc{tag[j]}{r}") for r in range(rank)] for j in range(len(ts))]
    rows = rows or [r * in_n for r in range(rank)]
    load = as_stored if half else widen
    product = half_dot if half else dot_or_mul

    def step(c):
        xvs = [m.let(load(x[tj * in_n + c]), f"xv{tag[j].rstrip('_')}") for j, tj in enumerate(ts)]
        for r in range(rank):
            a = load(A[rows[r] + c])
            if len(ts) > 1:
                a = m.let(a, f"a{r}")
            for j, xv in enumerate(xvs):
                accs[j][r] += product(a, xv)

    unrolled_or_loop(m, lane, in_n, lanes, (rank + 1) * len(ts), step, "c", unroll)
    return accs if isinstance(t, list) else accs[0]



def b_row(m, Bm, i, rank):
    """Row i of B as lets: vec4 pieces when rank % 4 == 0, else scalars."""
    if width(rank) == 4:
        return [m.let(widen(Bm[i * (rank // 4) + q]), f"b{q}") for q in range(rank // 4)]
    return [m.let(widen(Bm[i * rank + r]), f"b{r}") for r in range(rank)]


def row_element(row, r: int):
    """Element r of a row from b_row (vec4 pieces or scalars)."""
    return row[r] if row[0].type == f32 else getattr(row[r // 4], "xyzw"[r % 4])


def row_dot(row, hs):
    """sum_r row[r] * h[r] for a row from b_row (vec4 pieces or scalars)."""
    if row[0].type == vec4f:
        terms = [B.dot(v, vec4f(*hs[4 * q:4 * q + 4])) for q, v in enumerate(row)]
    else:
        terms = [v * h for v, h in zip(row, hs)]
    return sum_terms(terms)


# The longest run of terms one sum adds left to right (the order of a loop).
# A longer sum adds runs of this many and then their totals, so an expression's
# depth stays near SUM_RUN + len / SUM_RUN: a left-deep chain of 512 terms (row_dot
# at rank 2048) was too deep for the compiler's recursive walks.
SUM_RUN = 64


def sum_terms(terms: list):
    """terms[0] + terms[1] + ..., in runs of at most SUM_RUN terms (the same
    order as before for up to SUM_RUN terms)."""
    while len(terms) > SUM_RUN:
        terms = [_left_sum(terms[k:k + SUM_RUN]) for k in range(0, len(terms), SUM_RUN)]
    return _left_sum(terms)


def _left_sum(terms: list):
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def b_row_dot(m, Bm, i, rank, hs):
    """sum_r B[i, r] * h[r], with vec4 loads of the row when rank % 4 == 0."""
    return row_dot(b_row(m, Bm, i, rank), hs)


def load_h(m, h, rank, t, threads):
    """Copy h[t] into workgroup memory once; each thread reads it from there."""
    tid = m.local_index()
    hw = m.shared(f32, rank, "hw")
    with m.loop(tid, rank, threads, name="r") as r:
        hw[r] = h[t * rank + r]
    m.barrier()
    return [m.let(hw[r], f"h{r}") for r in range(rank)]


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)
