"""Gradients into the arrays a ``score_mod`` captures (a learned relative-bias table, per-head slopes), added by
the dK/dV kernels where they form dS.

For an element ``(b, h, i, j)`` the kernels know ``ds``, the gradient of the loss in the score_mod's result (P (dP -
delta), before the score_mod's own chain rule).  What the element adds to ``table[t]`` is ``ds * d score_mod / d
table[t]``, for each entry the function reads.  The function's code is rewritten once per place it reads the table
(a *site*, ``table[e0, e1]``): the site function computes the same value with that read stepped into the complex
plane, ``table[at] + i T``, and returns the result with the index it read, ``(value, at)`` (``at`` = ``MISSING``
where the read did not run: a branch not taken).  ``Im value / T`` is then the derivative in that entry, exact to
rounding (the complex step), and ``capture_grad`` adds ``ds`` times it into the gradient buffer at ``at`` with an
atomic, one per site an element.  Two sites reading the same entry each add their part.

What cannot be rewritten this way is refused before any launch, naming the function and the array: no source
(a function built at run time), a read inside a loop or a comprehension (one index per site), a read that is not
one element (a slice, fewer indices than dimensions), the array passed on to another function, or written.
``MISSING`` indices, negative indices (wrapped as the read wraps them) and the atomic adds are this module's; the
kernels call ``capture_grad(ds, score, b, h, q_idx, kv_idx)`` where ``P > 0``.
"""
import ast
import inspect
import textwrap

import numpy as np

MISSING = -(1 << 62)              # a site's index where its read did not run
_AT, _I64, STEP = "_fnb_at", "_fnb_i64", "_fnb_step"   # the names the site functions use


def function_def(fn, label):
    """``fn``'s code as an ``ast.FunctionDef`` (a lambda as the function returning its body), decorators
    dropped; ValueError where its source cannot be found or named unambiguously."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise ValueError(f"{label}: its gradient into captured arrays is taken from its source code, which Python "
                         f"cannot find ({e}); define it with def in a file") from e
    code = fn.__code__
    args = list(code.co_varnames[:code.co_argcount])
    tree = _parse(src)
    if tree is None:
        raise ValueError(f"{label}: its source could not be parsed on its own; define it with def")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn.__name__
             and [a.arg for a in n.args.args] == args]
    if fn.__name__ == "<lambda>":
        found = [ast.parse(f"def _fnb_lambda({', '.join(args)}):\n    return {ast.unparse(n.body)}").body[0]
                 for n in ast.walk(tree) if isinstance(n, ast.Lambda) and [a.arg for a in n.args.args] == args]
    if len(found) != 1:
        raise ValueError(f"{label}: {len(found)} definitions in its source lines match it; define it with def, "
                         "once, to take its gradient into captured arrays")
    fdef = found[0]
    fdef.decorator_list = []
    return fdef


def _parse(src):
    """The module of ``src``, or of its first line alone (a lambda inside a call spanning lines), or None."""
    for text in (src, src.splitlines()[0].rstrip().rstrip("\\").rstrip(",")):
        for candidate in (text, "(" + text + ")"):
            try:
                return ast.parse(candidate)
            except SyntaxError:
                continue
    return None


def read_sites(fdef, name, ndim, label):
    """The reads ``name[e0, ..., e_{ndim-1}]`` in ``fdef``, in source order; ValueError for any use of ``name``
    that is not such a read outside loops (module docstring)."""
    sites, parents = [], {}
    for node in ast.walk(fdef):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(fdef):
        if not (isinstance(node, ast.Name) and node.id == name):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr in ("shape", "ndim", "size"):
            continue
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "len"
                and parent.args == [node]):
            continue
        if not (isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load)):
            raise ValueError(f"{label} uses {name!r} other than by reading one element (line {node.lineno} of its "
                             "source): its gradient into that array is taken only through element reads")
        index = parent.slice.elts if isinstance(parent.slice, ast.Tuple) else [parent.slice]
        if len(index) != ndim or any(isinstance(e, ast.Slice) for e in index):
            raise ValueError(f"{label} reads {name!r} (ndim {ndim}) with {len(index)} indices or a slice (line "
                             f"{node.lineno}): its gradient needs one element a read")
        up, below = parents.get(parent), parent
        while up is not None and up is not fdef:
            # the stepped value must stay complex to its return: an order, a cast or a real function of it would
            # drop its imaginary part (Numba cannot compile them for a complex value either); a read inside another
            # read's index, likewise
            if isinstance(up, ast.Compare) or (isinstance(up, ast.Subscript) and below is not up.value):
                raise ValueError(f"{label} compares {name!r}'s element or indexes with it (line {node.lineno}): its "
                                 "gradient is taken by stepping the element into the complex plane, which has no order")
            cmath_call = (isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute)
                          and isinstance(up.func.value, ast.Name) and up.func.value.id == "cmath")
            if isinstance(up, ast.Call) and not cmath_call:
                raise ValueError(f"{label} passes {name!r}'s element to a function (line {node.lineno}): its gradient "
                                 "is taken by the complex step, through arithmetic and cmath only (abs, min, int, "
                                 "math.* drop the imaginary part or refuse a complex value)")
            if isinstance(up, (ast.For, ast.While, ast.AsyncFor, ast.ListComp, ast.SetComp, ast.DictComp,
                               ast.GeneratorExp, ast.Lambda, ast.FunctionDef)):
                raise ValueError(f"{label} reads {name!r} inside a loop, comprehension or nested function (line "
                                 f"{node.lineno}): its gradient needs each read to run at most once")
            if isinstance(up, (ast.IfExp, ast.BoolOp)) or (isinstance(up, ast.Compare) and len(up.ops) > 1):
                raise ValueError(f"{label} reads {name!r} inside a conditional expression, and / or, or a chained "
                                 f"comparison (line {node.lineno}): write the condition as an if statement, so that "
                                 "its gradient knows whether the read ran")
            up, below = parents.get(up), up
        sites.append(parent)
    if not sites:
        raise ValueError(f"{label} reads no element of {name!r} in its own code")
    return sites


class _Site(ast.NodeTransformer):
    """``fdef`` with read ``site`` stepped (``table[at] + step``), its index computed just before the statement
    holding it (``at = (int64(e0), ...)``: Numba cannot type an assignment expression of a tuple), and ``(value,
    at)`` returned."""

    def __init__(self, site, ndim, parents, top):
        self.site, self.ndim, self.top = site, ndim, top
        self.statement = parents[site]
        while not isinstance(self.statement, ast.stmt):
            self.statement = parents[self.statement]

    def visit_Subscript(self, node):
        if node is not self.site:
            return self.generic_visit(node)
        at = ast.Name(_AT, ast.Load())
        read = ast.Subscript(node.value, at if self.ndim > 1 else ast.Subscript(at, ast.Constant(0), ast.Load()),
                             ast.Load())
        return ast.BinOp(read, ast.Add(), ast.Name(STEP, ast.Load()))

    def visit_FunctionDef(self, node):
        if node is self.top:
            return self.generic_visit(node)
        return node                              # a helper defined inside: its returns are its own

    visit_Lambda = visit_FunctionDef

    def visit_Return(self, node):
        kept = self._index_before(node)
        value = self.visit(node.value) if node.value is not None else ast.Constant(None)
        new = ast.Return(ast.Tuple([value, ast.Name(_AT, ast.Load())], ast.Load()))
        return [kept, new] if kept is not None else new

    def generic_visit(self, node):
        if isinstance(node, ast.stmt) and node is self.statement and not isinstance(node, ast.Return):
            kept = self._index_before(node)
            return [kept, super().generic_visit(node)]
        return super().generic_visit(node)

    def _index_before(self, node):
        if node is not self.statement:
            return None
        index = self.site.slice.elts if isinstance(self.site.slice, ast.Tuple) else [self.site.slice]
        return ast.Assign([ast.Name(_AT, ast.Store())], ast.Tuple(
            [ast.Call(ast.Name(_I64, ast.Load()), [e], []) for e in index], ast.Load()), lineno=node.lineno)


def site_functions(fn, name, ndim, step, label):
    """One function a read of ``name`` in ``fn`` (``read_sites``): ``site(score, b, h, q_idx, kv_idx) -> (value,
    at)``, ``value`` complex with the read stepped by ``step`` (``1j * T``), ``at`` the tuple of the read's
    ``ndim`` indices (int64), ``MISSING`` where it did not run.  Each keeps ``fn``'s closure and globals."""
    fdef = function_def(fn, label)
    code = fn.__code__
    sites = read_sites(fdef, name, ndim, label)
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    glob = dict(fn.__globals__)
    glob.update({_I64: np.int64, STEP: step})
    made = []
    for k in range(len(sites)):
        tree = ast.parse(textwrap.dedent(ast.unparse(fdef)))    # a fresh copy, the site found again by position
        copy = tree.body[0]
        site = read_sites(copy, name, ndim, label)[k]
        parents = {child: node for node in ast.walk(copy) for child in ast.iter_child_nodes(node)}
        new = _Site(site, ndim, parents, copy).visit(copy)
        new.name = "site"
        new.body.insert(0, ast.parse(f"{_AT} = ({', '.join([str(MISSING)] * ndim)},)").body[0])
        text = (f"def _fnb_factory({', '.join(code.co_freevars)}):\n"
                + textwrap.indent(ast.unparse(ast.fix_missing_locations(new)), "    ") + "\n    return site\n")
        space = {}
        exec(compile(text, f"<{label}: read {k} of {name!r}, stepped>", "exec"), glob, space)
        site_fn = space["_fnb_factory"](*cells)
        site_fn.__qualname__ = f"{getattr(fn, '__qualname__', fn.__name__)}.<read {k} of {name}>"
        made.append(site_fn)
    return made


def make_capture_grad(sites, grads, shapes, inv_t):
    """``capture_grad(ds, score, b, h, q_idx, kv_idx)``: for each compiled site function, ``ds * (Im(value) *
    inv_t)`` added atomically into its gradient buffer (``grads[k]``, shaped ``shapes[k]``) at the index it read,
    a negative index wrapped as the read wrapped it; an index still outside the array (a read past its end, which
    the host probes did not meet) adds nothing rather than write outside the buffer."""
    from numba import cuda
    from ._jit import device_function

    lines = ["def capture_grad(ds, score, b, h, q_idx, kv_idx):"]
    space = {"cuda": cuda, "MISSING": MISSING, "INV_T": inv_t}
    for k, (site, grad, shape) in enumerate(zip(sites, grads, shapes)):
        space[f"site{k}"], space[f"grad{k}"] = site, grad
        lines.append(f"    v{k}, at{k} = site{k}(score, b, h, q_idx, kv_idx)")
        lines.append(f"    if at{k}[0] != MISSING:")
        for d, n in enumerate(shape):
            lines.append(f"        i{k}_{d} = at{k}[{d}] + {n} if at{k}[{d}] < 0 else at{k}[{d}]")
        inside = " and ".join(f"0 <= i{k}_{d} < {n}" for d, n in enumerate(shape))
        index = f"i{k}_0" if len(shape) == 1 else "(" + ", ".join(f"i{k}_{d}" for d in range(len(shape))) + ")"
        lines.append(f"        if {inside}:                # (a read outside the array was wrong already: no write)")
        lines.append(f"            cuda.atomic.add(grad{k}, {index}, ds * (v{k}.imag * INV_T))")
    if not sites:
        lines.append("    return")
    exec(compile("\n".join(lines), "<capture_grad>", "exec"), space)
    return device_function(space["capture_grad"])
