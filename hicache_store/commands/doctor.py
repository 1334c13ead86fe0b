"""``hicache-store doctor URL``: why a deployment does (not) hit what a store holds.

Lists the namespaces the store holds; given a deployment (its SGLang extra-config and/or the
flags below), says which namespace it uses, whether the store holds it, and otherwise the
nearest stored namespace and the fields that differ; given prompts, how much of them would
hit::

    hicache-store doctor file:///var/cache/kv --extra-config @extra.json \\
        --model-id /models/llama --page-size 64 --topology tp=4,pp=1 --prompts prompts.jsonl

Inputs not given are taken from the stored namespaces (so they never count as differences);
the weights' revision among them, unless ``--model-path`` (the directory the engine loads,
whose weights identity the integrations put in the namespace) or a ``model_revision`` is
given: the report says which, or that it is unknown.
For a file-layout root (``file://``, ``hf3fs://``) it also reports the root's filesystem type
and the host its index records, even when the store's open is refused (another host uses the
index, or the default index on a network filesystem).
Exit code 0 when no deployment is given or the store holds its namespace, 1 when it does not
or the store cannot be opened from here; a store that does not exist is said in one line and
is never created.
Library: ``hicache_store.ops.doctor``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from hicache_store._sync import run_sync
from hicache_store.backends import RootSite
from hicache_store.backends.index import IndexCheck
from hicache_store.commands._common import (
    add_prompts_argument,
    add_store_command,
    add_tenant_key_argument,
)
from hicache_store.errors import UsageError
from hicache_store.layout.namespace import HASH_ALGOS, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.ops.config import layered, require, resolve
from hicache_store.ops.progress import counted
from hicache_store.ops.store import open_store
from hicache_store.weights import WeightsIdentity, revision_source, weights_identity

if TYPE_CHECKING:
    from hicache_store.ops.deployment import Deployment


def register(subparsers: Any) -> None:
    parser = add_store_command(
        subparsers, "doctor",
        help="why a deployment does (not) hit: stored namespaces vs the deployment's", doc=__doc__)
    dep = parser.add_argument_group(
        "the deployment (any subset; what is not given is taken from the stored namespaces)")
    dep.add_argument("--extra-config", metavar="JSON|@FILE",
                     help="the deployment's SGLang --hicache-storage-backend-extra-config")
    dep.add_argument("--model-id", metavar="ID",
                     help="SGLang's served model name (default there: its --model-path as given)")
    dep.add_argument("--model-path", metavar="DIR|ID",
                     help="the model directory (or hub id) the engine loads: its weights "
                     "identity is the namespace's revision, as the integrations derive it "
                     "(default: unknown, taken from the stored namespaces)")
    dep.add_argument("--model-revision",
                     help="the deployment's explicit model_revision (overrides --model-path)")
    dep.add_argument("--dtype", help="KV dtype (bfloat16, float16, float8_e4m3fn, ...)")
    dep.add_argument("--page-size", type=int, help="tokens per page (SGLang's --page-size)")
    dep.add_argument("--grid", metavar="LxH", help="partition grid, e.g. 1x1 or 30x2")
    dep.add_argument("--tenant-salt", help="tenant salt")
    add_tenant_key_argument(dep, "the deployment's tenant key ring: its namespace is sealed",
                            deployment=True)
    dep.add_argument("--topology", default="tp=1,pp=1",
                     help="the deployment's TP x PP (default: tp=1,pp=1); decides the default "
                     "grid and which ranks the prompt check asks")
    dep.add_argument("--layers", type=int, help="model layers (with --kv-heads, --head-dim)")
    dep.add_argument("--kv-heads", type=int, help="KV heads of the model")
    dep.add_argument("--head-dim", type=int, help="head dimension")
    dep.add_argument("--hash-algo", default="sha256", choices=list(HASH_ALGOS),
                     help="page-hash algorithm (default: sha256, as SGLang)")
    src = parser.add_argument_group("prompts")
    add_prompts_argument(src)
    src.add_argument("--tokenizer", metavar="DIR",
                     help="local Hugging Face tokenizer for text prompts (input_ids need none)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    layered(parser, section="doctor")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    from hicache_store.backends.errors import UnsafeIndexError
    from hicache_store.ops.deployment import Deployment, deployment_keys, merge_extra_config
    from hicache_store.ops.doctor import Diagnosis, diagnose, site_of

    try:
        topology = Topology.parse(args.topology)
        config = merge_extra_config(args.extra_config, {
            "tenant_salt": ("--tenant-salt", args.tenant_salt),
            "model": ("--model-id", args.model_id),
            "grid": ("--grid", args.grid),
            "kv_dtype": ("--dtype", args.dtype),
            "model_revision": ("--model-revision", args.model_revision),
        })
        weights = _weights_of(args.model_path)
        shape_flags = (args.layers, args.kv_heads, args.head_dim)
        if any(v is not None for v in shape_flags) and None in shape_flags:
            raise ValueError("give all of --layers, --kv-heads and --head-dim, or none")
        shape = None if args.layers is None else ModelShape.mha(
            args.layers, args.kv_heads, args.head_dim)
        if args.page_size is not None and args.page_size < 1:
            raise ValueError(f"--page-size must be positive, got {args.page_size}")
        keys = deployment_keys(config, args.tenant_key_file)  # as the adapter finds them
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    given = args.extra_config or any(v is not None for v in (
        args.model_id, args.dtype, args.page_size, args.grid, args.tenant_salt,
        args.tenant_key_file, shape, args.model_path, args.model_revision))
    deployment = Deployment(config=config, page_size=args.page_size, topology=topology,
                            shape=shape, hash_algo=args.hash_algo, keys=keys,
                            weights=weights) if given else None
    if args.prompts and deployment is None:
        raise UsageError("--prompts needs a deployment (--extra-config or the flags)")
    prompts = _prompts(args) if args.prompts else []

    site = site_of(url)  # before the open, which may refuse this host

    async def go() -> Any:
        try:
            # existing=True: a diagnosis never creates the store it was asked about, and
            # read_only: writes nothing to it (so it works on a full filesystem too).
            backend = open_store(url, existing=True, read_only=True)
        except UnsafeIndexError as exc:
            return Diagnosis(site=site, refused=str(exc))
        try:
            found = await diagnose(backend, deployment, prompts)
        finally:
            await backend.close()
        found.site = site_of(url)  # as the open left it (a new root's record, say)
        return found

    found = run_sync(go())
    if args.json:
        print(json.dumps({**_as_json(found), "weights": _weights_json(deployment)}, indent=2))
    else:
        lines = _report(url, found, deployment is not None)
        if deployment is not None:
            lines.append(f"weights: {_weights_line(deployment)}")
        print("\n".join(lines))
    if found.refused is not None:
        return 1
    return 0 if deployment is None or found.found else 1


def _weights_of(model_path: str | None) -> WeightsIdentity | None:
    """The weights identity of ``--model-path`` (``ValueError`` when nothing there names
    weights: a wrong path is not an unknown identity)."""
    if model_path is None:
        return None
    found = weights_identity(model_path)
    if found is None:
        raise ValueError(f"--model-path {model_path}: no weights files there (nor a hub "
                         "snapshot in the local cache)")
    return found


def _weights_line(deployment: Deployment) -> str:
    """Where the deployment's revision comes from, or that it is unknown."""
    return revision_source(
        deployment.config.model_revision, deployment.weights, given="as given",
        unknown="unknown: give --model-path (the directory the engine loads) or model_revision; "
                "taken from the stored namespace, so it counts as no difference")


def _weights_json(deployment: Deployment | None) -> dict[str, Any] | None:
    if deployment is None:
        return None
    return {"revision": deployment.model_revision, "source": _weights_line(deployment)}


def _prompts(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    from hicache_store.ops.sources import HFTokenizer, PromptError, load_prompts

    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else None
    out = []
    try:
        for prompt in load_prompts(args.prompts):
            if prompt.input_ids is not None:
                out.append((prompt.origin, list(prompt.input_ids)))
            elif tokenizer is None:
                raise UsageError(f"{prompt.origin}: a text prompt needs --tokenizer DIR")
            else:
                out.append((prompt.origin, tokenizer.tokenize(prompt)))
    except PromptError as exc:
        raise UsageError(str(exc)) from None
    return out


def _describe(ns: Namespace) -> str:
    dims = (f"{ns.num_layers} layers x {ns.num_kv_heads} KV heads x {ns.head_dim}"
            if ns.kv_kind == "mha" else f"{ns.num_layers} layers, MLA dim {ns.head_dim}")
    salt = "salted" if ns.tenant_salt else "no salt"
    sealed = "  sealed" if ns.sealed else ""
    weights = f"weights {ns.model_revision}" if ns.model_revision else "weights unknown"
    return (f"{ns.digest}  {ns.model}  {weights}  {ns.dtype}  page {ns.page_size}  "
            f"grid {ns.grid}  {dims}  {salt}{sealed}")


def _site_lines(site: RootSite) -> list[str]:
    lines = [f"root: {site.root}", f"  filesystem: {site.filesystem or 'unknown (no statfs)'}"]
    if site.index == "none":
        lines.append("  index: none (any host may use this root; nothing recorded)")
    elif site.record_error is not None:
        lines.append(f"  index: {site.index or 'not created yet'}; host record: {site.record_error}")
    elif site.host_record is None:
        lines.append(f"  index: {site.index or 'not created yet'}; no host recorded yet")
    else:
        mine = "this host" if site.this_host_recorded else (
            f"NOT this host: {site.this_host.hostname} (boot id {site.this_host.boot_id})")
        lines.append(f"  index: {site.index or 'sqlite'}; host recorded: "
                     f"{site.host_record.describe()}; {mine}")
    if site.filesystem is not None and site.filesystem.network and site.index != "none":
        lines.append("  warning: the default index on a network or FUSE filesystem serves one "
                     "host only; a root several hosts use takes index=none")
    return lines


def _index_lines(check: IndexCheck) -> list[str]:
    """The store's index against a listing (``Backend.check_index``)."""
    lines = [f"  index ({check.kind}): {check.indexed_objects} objects, {check.indexed_bytes} "
             f"bytes; listing: {check.listed_objects} objects, {check.listed_bytes} bytes"]
    if check.consistent:
        lines.append("  the index and the listing agree")
    else:
        lines.append(f"  differs: {check.unindexed} objects not indexed (published by a writer "
                     f"that lost its lease, or placed by hand), {check.missing} indexed but gone"
                     " (hicache-store gc reconciles both)")
        lines += [f"    e.g. {key}" for key in check.examples]
    lines += [f"  namespace {ns or '(none)'}: {size} bytes" for ns, size in
              sorted(check.usage.items())]
    if check.details.get("rebuilt_at"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(check.details["rebuilt_at"] / 1000))
        lines.append(f"  rebuilt from a listing of the store at {when}: pins and retention set "
                     "before then were lost with the old index")
    if "writers" in check.details:
        lines.append(f"  writers registered: {check.details['writers']}")
    return lines


def _report(url: str, found: Any, has_deployment: bool) -> list[str]:
    lines = [] if found.site is None else _site_lines(found.site)
    if found.refused is not None:
        return [*lines, f"{url}: refused: {found.refused}"]
    if found.index is not None:
        lines += _index_lines(found.index)
    if not found.listing:
        lines.append(f"{url}: this backend cannot list keys; only the deployment's own "
                     "manifest was looked up")
    else:
        lines.append(f"{url}: {counted(len(found.namespaces), 'namespace')}")
        lines += [f"  {_describe(ns)}" for ns in found.namespaces]
        lines += [f"  {key}: unreadable manifest" for key in found.unreadable]
    if not has_deployment:
        return lines
    if found.deployment is None:
        lines.append("deployment: its namespace cannot be derived (no stored namespace to "
                     "complete it from; give --layers/--kv-heads/--head-dim, --dtype, "
                     "--page-size and --model-id)")
    elif found.found:
        lines.append(f"deployment: namespace {found.deployment.digest}, stored")
    else:
        lines.append(f"deployment: namespace {found.deployment.digest}, NOT in the store")
        if found.nearest is not None:
            lines.append(f"  nearest stored: {found.nearest.digest}; differs in:")
            lines += [f"    {d}" for d in found.differences]
    if found.prompts:
        total, hit = found.prompt_tokens, found.hit_tokens
        share = 100.0 * hit / total if total else 0.0
        lines.append(f"prompts: {len(found.prompts)}, {total} tokens; {hit} would hit "
                     f"({share:.1f}%) with {found.deployment.digest if found.deployment else '?'}")
        lines += [f"  {p.origin}: {p.hit_tokens}/{p.tokens} tokens" for p in found.prompts]
    return lines


def _site_json(site: RootSite | None) -> dict[str, Any] | None:
    if site is None:
        return None
    fs = site.filesystem
    return {
        "root": site.root,
        "filesystem": None if fs is None else {
            "name": fs.name, "f_type": fs.magic, "network": fs.network},
        "index": site.index,
        "host_record": None if site.host_record is None else site.host_record.to_json(),
        "host_record_error": site.record_error,
        "this_host": {"hostname": site.this_host.hostname, "boot_id": site.this_host.boot_id},
        "this_host_recorded": site.this_host_recorded,
    }


def _as_json(found: Any) -> dict[str, Any]:
    return {
        "site": _site_json(found.site),
        "refused": found.refused,
        "index": None if found.index is None else {
            **vars(found.index), "consistent": found.index.consistent},
        "listing": found.listing,
        "namespaces": [ns.to_json() for ns in found.namespaces],
        "unreadable_manifests": found.unreadable,
        "deployment": None if found.deployment is None else found.deployment.to_json(),
        "found": found.found,
        "nearest": None if found.nearest is None else found.nearest.digest,
        "differences": [{"field": d.field, "description": str(d)} for d in found.differences],
        "prompts": [vars(p) for p in found.prompts],
        "prompt_tokens": found.prompt_tokens,
        "hit_tokens": found.hit_tokens,
    }
