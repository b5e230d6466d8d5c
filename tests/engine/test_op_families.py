"""Op families are parts the executor owns (DESIGN.md): each executor's ops build the parts of the served line's
declared op_families and no other, each part has every method of its Protocol (engine/models/ops.py), the GPU
plan sizes exactly those parts' buffers, and no ops class stacks mixins. Real configs (bench/configs), no weights,
no GPU."""
from __future__ import annotations

import ast
import glob
import os

import numpy as np
import pytest

from engine.executor.cpu_lora_ops import NumpyLoRAOps
from engine.executor.cpu_ops import NumpyOps
from engine.model_config import ModelConfig
from engine.models.ops import DeltaNetOps, DSV4Ops, LoRAOps, MLAOps, MoEOps
from engine.models.registry import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "bench", "configs")
PROTOCOLS = {"moe": MoEOps, "mla": MLAOps, "deltanet": DeltaNetOps, "dsv4": DSV4Ops}
LINES = {"qwen3-4b": set(), "qwen3-30b-a3b": {"moe"}, "deepseek-v2-lite": {"moe", "mla"}, "kimi-k2": {"moe", "mla"},
         "qwen3.5-4b": {"deltanet"}, "deepseek-v4-flash": {"moe", "dsv4"}}


def protocol_methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("name", sorted(LINES))
def test_numpy_ops_build_the_lines_families(name):
    model = build_model(ModelConfig.from_file(os.path.join(CONFIGS, name)))
    assert model.op_families == LINES[name]
    ops = NumpyOps(np.zeros((1, 1, 16, 1, 8), np.float32), model.op_families, state={},
                   lora=NumpyLoRAOps({}, 2))
    for family, protocol in PROTOCOLS.items():
        part = getattr(ops, family)
        assert (part is not None) == (family in LINES[name]), family
        if part is not None:
            assert all(callable(getattr(part, m, None)) for m in protocol_methods(protocol)), family
    assert all(callable(getattr(ops.lora, m, None)) for m in protocol_methods(LoRAOps))
    assert NumpyOps(np.zeros(1)).lora is None


@pytest.mark.parametrize("name", sorted(LINES))
def test_gpu_plan_sizes_the_lines_parts_only(name):
    from engine.executor.gpu_ops import GpuOps
    from engine.executor.gpu_plan import DeviceInfo, gpu_plan
    from engine.executor.options import options_of

    model = build_model(ModelConfig.from_file(os.path.join(CONFIGS, name)))
    plan = gpu_plan(options_of(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024), model,
                    DeviceInfo(name="H200", num_sms=132, total_memory=141 << 30, compute_capability="90"))
    assert plan.families == LINES[name]
    parts = {"moe": GpuOps.moe_class.nbytes(plan), "mla": GpuOps.mla_class.nbytes(plan),
             "lora": GpuOps.lora_class.nbytes(plan)}
    assert {family for family, n in parts.items() if n} == LINES[name] & {"moe", "mla"}
    assert GpuOps.families_nbytes(plan) == sum(parts.values())


def test_no_class_in_the_engine_stacks_mixins():
    """Every class of engine/ (the executors' ops and their parts, the executors, a tensor-parallel rank's)
    derives from one class at most: an op family or the host KV tier is a part its owner holds."""
    files = glob.glob(os.path.join(ROOT, "engine", "**", "*.py"), recursive=True)
    stacked = [f"{os.path.relpath(f, ROOT)}:{node.name}" for f in files for node in ast.walk(ast.parse(open(f).read()))
               if isinstance(node, ast.ClassDef) and len(node.bases) > 1]
    assert stacked == []


def engine_classes() -> dict[str, tuple[list[str], set[str], set[str]]]:
    """Each class of engine/executor, engine/parallel and engine/models: its bases, the names its methods
    assign on self, its methods (properties excluded: a property's setter assigns its own name)."""
    out = {}
    for f in [f for d in ("executor", "parallel", "models") for f in glob.glob(os.path.join(ROOT, "engine", d, "*.py"))]:
        for node in ast.walk(ast.parse(open(f).read())):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)
                       and not any("property" in ast.unparse(d) or "setter" in ast.unparse(d) for d in m.decorator_list)}
            assigned = {t.attr for m in node.body if isinstance(m, ast.FunctionDef) for s in ast.walk(m)
                        if isinstance(s, (ast.Assign, ast.AnnAssign))
                        for target in (s.targets if isinstance(s, ast.Assign) else [s.target])
                        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            out[node.name] = ([ast.unparse(b) for b in node.bases], assigned, methods)
    return out


def test_no_attribute_shadows_a_method():
    """An attribute a part or an executor sets on itself never hides a method of its class, of a class it
    derives from or of one deriving from it (GpuOps held its logits buffer under the name of the logits op
    that ComposedOps and the rank ops define; PrefillAttention its key rows under a static method's name)."""
    classes = engine_classes()

    def lineage(name):
        bases = classes[name][0]
        return [name] + [c for b in bases if b in classes for c in lineage(b)]
    clashes = []
    for name in classes:
        chain = lineage(name)
        assigned, methods = (set().union(*(classes[c][i] for c in chain)) for i in (1, 2))
        clashes += [f"{name}.{a}" for a in sorted(assigned & methods)]
    assert clashes == []
