"""SGLang 0.5.23's own modules as the oracle of the differential tests (test_sglang_*_cpu.py).

``sglang()`` imports what a test needs from SGLang or skips the test, saying why; with
``KVSHARD_REQUIRE_SGLANG=1`` (``.ci/run`` sets it) a missing SGLang fails the test instead.
``scripts/install-sglang.sh`` installs the pinned environment these tests run in.

``tally(test, cases, operations)`` counts what a differential test compared; the suite's
summary prints one line per test (conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

import importlib
import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest

SGLANG_VERSION = "0.5.23"

#: Per test: [cases, operations] compared against SGLang.
COUNTS: dict[str, list[int]] = defaultdict(lambda: [0, 0])


def required() -> bool:
    return os.environ.get("KVSHARD_REQUIRE_SGLANG", "") not in ("", "0")


def unavailable(reason: str) -> None:
    """Skips the calling test module (fails it when SGLang is required): for what the SGLang
    environment brings and a plain test venv lacks (hypothesis)."""
    if required():
        pytest.fail(f"KVSHARD_REQUIRE_SGLANG is set: {reason}", pytrace=False)
    pytest.skip(f"{reason}: scripts/install-sglang.sh installs it", allow_module_level=True)


def sglang(**modules: str) -> SimpleNamespace:
    """SGLang's modules by the names given (``placement="mem_cache.page_interleave"`` is
    ``sglang.srt.mem_cache.page_interleave`` as ``.placement``), or a skip (a failure when
    required) naming what did not import. The installed version must be the pinned one."""
    try:
        import sglang as sg

        version = getattr(sg, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("sglang")
        if version != SGLANG_VERSION:
            raise ImportError(f"sglang {version} is installed; these tests pin {SGLANG_VERSION}")
        with warnings.catch_warnings():
            # Its quantization modules warn that they need CUDA when imported on the CPU.
            warnings.simplefilter("ignore")
            out = {name: importlib.import_module(f"sglang.srt.{m}") for name, m in modules.items()}
    except ImportError as why:
        reason = (
            f"SGLang {SGLANG_VERSION} does not import ({why}): scripts/install-sglang.sh installs "
            "the environment these tests run SGLang's own objects in"
        )
        if required():
            pytest.fail(f"KVSHARD_REQUIRE_SGLANG is set: {reason}")
        pytest.skip(reason)
    return SimpleNamespace(**out)


def tally(test: str, cases: int = 0, operations: int = 0) -> None:
    """Adds to what ``test`` compared against SGLang."""
    COUNTS[test][0] += cases
    COUNTS[test][1] += operations


def sglang_function(module: str, qualname: str, **names):
    """SGLang's own function ``qualname`` (``"Class.method"`` or ``"function"``) of module
    ``module`` (under ``sglang.srt``), compiled from its source as installed, byte for byte, without
    importing the module: a few modules whose functions the tests compare (the scheduler's
    ``schedule_policy``, the Mooncake connector) import the whole server (OpenAI protocol types,
    Prometheus, the Mooncake engine), which these tests do not install. ``names`` are the
    module-level names the function uses."""
    import ast
    import importlib.util

    sglang()  # the pinned version, or a skip
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(spec.submodule_search_locations[0], "srt", *module.split(".")) + ".py"
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, path)
    scope: list = tree.body
    node = None
    for part in qualname.split("."):
        node = next(
            n for n in scope
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
        scope = node.body
    assert isinstance(node, ast.FunctionDef), qualname
    node.decorator_list = [d for d in node.decorator_list if not (isinstance(d, ast.Name) and d.id == "staticmethod")]
    code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec")
    namespace = {"__name__": f"sglang.srt.{module}", **names}
    exec(code, namespace)
    return namespace[node.name]


def host_pools(layout: str, *, skip=(False, True, False), pages: int = 8, row: int = 576, device: str = "cpu"):
    """SGLang's own host pools of a DSA model, built by its classes as its HiCache assembler
    builds them, with ``pin_memory=False`` (SGLang's flag: nothing registered with CUDA): its MLA
    host pool (``MLATokenToKVPoolHost``: one target layer per entry of ``skip``, the packed MTP
    draft as the tail layer, ``row``-byte latent rows) and its DSA indexer host pool
    (``DSAIndexerPoolHost``: a layer whose ``skip`` is True reuses another layer's top-k and has
    no indexer buffer; the draft's indexer is the tail layer). The device pool holds ``pages``
    pages per layer plus the padding page (SGLang's device pool shape), the host pools twice
    that plus one. Returns a namespace with ``kv``, ``indexer`` and the device buffers
    ``target`` (latent, per layer), ``draft`` (one), ``target_indexer`` (per layer, empty where
    skipped) and ``draft_indexer`` (one)."""
    import torch

    sg = sglang(
        storage="mem_cache.hicache_storage",
        info="mem_cache.device_pool_info",
        mla="mem_cache.pool_host.mla",
        dsa="mem_cache.pool_host.dsa",
        decl="mem_cache.pool_host.host_pool_decl",
    )
    layers = len(skip)
    page = 64
    rows = pages * page + page
    target = [torch.zeros((rows, 1, row), dtype=torch.uint8, device=device) for _ in range(layers)]
    draft = [torch.zeros((rows, 1, row), dtype=torch.uint8, device=device)]

    def info(buffers, layer_ids):
        return sg.info.MLABufferInfo(
            buffers=tuple(buffers),
            data_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device),
            layer_indices=tuple(layer_ids), device_layer_num=len(layer_ids), page_size=page,
            kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=row, dtype=torch.uint8,
            device=torch.device(device), packed_fp8=True,
        )

    kv = sg.mla.MLATokenToKVPoolHost(
        info(target, range(layers)), 2.0, 0, page, layout, pin_memory=False, device="cpu",
        override_kv_cache_dim=row, draft_buffer_infos=(info(draft, [0]),),
        device_capacity_tokens=pages * page, start_layer=0, end_layer=layers, target_layer_num=layers,
    )
    target_indexer = [
        torch.zeros((0 if s else pages + 1, 8448), dtype=torch.uint8, device=device) for s in skip
    ]
    draft_indexer = [torch.zeros((pages + 1, 8448), dtype=torch.uint8, device=device)]
    device_pool = SimpleNamespace(
        device=device, index_k_with_scale_buffer=target_indexer, start_layer=0, end_layer=layers,
        layer_num=layers, store_dtype=torch.uint8, skip_topk_layers=list(skip), layer_shard_enabled=False,
    )
    draft_pool = SimpleNamespace(device=device, index_k_with_scale_buffer=draft_indexer)
    decl = sg.decl.HostPoolDecl(
        pool_name=sg.storage.PoolName.INDEXER, device_pool=device_pool,
        indices_from_pool=sg.storage.PoolName.KV, layout_source=sg.storage.PoolName.KV,
        storage_info=sg.decl.HostPoolStorageInfo(bytes_per_token_per_layer=8448 // page, dtype=torch.uint8),
        host_pool_builder=None, owned_device_layers=tuple(i for i, s in enumerate(skip) if not s),
    )
    indexer = sg.dsa.DSAIndexerPoolHost(decl, kv, packed_draft_device_pools=(draft_pool,), pin_memory=False)
    return SimpleNamespace(
        kv=kv, indexer=indexer, target=target, draft=draft, target_indexer=target_indexer,
        draft_indexer=draft_indexer, device_pool=device_pool, draft_pool=draft_pool,
    )
