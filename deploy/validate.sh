#!/usr/bin/env bash
# Offline checks of the deployment files in deploy/, run by .ci/run and by
# hand (`deploy/validate.sh` from anywhere in the repository):
#   1. yamllint on every YAML file here (deploy/.yamllint.yaml);
#   2. every Kubernetes object against the API schemas of the oldest and the
#      newest Kubernetes versions we support (kubernetes-validate, strict: an
#      unknown or misspelt field is an error, and so is a kind without a
#      schema);
#   3. the TOML manifest inside each ConfigMap parses, and the DaemonSet
#      agrees with it (config path, ConfigMap name, probe port, kubelet dir;
#      with DRA resources: token, NODE_NAME, the kubelet's plugin folders);
#   4. the same for the DRA variant (deploy/dra-render.sh: the base with the
#      Component deploy/dra/, needs kubectl), against Kubernetes 1.34 and 1.37.
# The tools live in a virtualenv under target/ci-venv, (re)built only when
# deploy/requirements-ci.txt changes. kustomization.yaml is not a
# Kubernetes object and gets step 1 only.
#
# `deploy/validate.sh FILE...` runs the same checks on the given files instead
# (e.g. what `helm template` rendered: deploy/helm/check.sh does this, with
# YAMLLINT_CONFIG naming the yamllint settings for generated YAML).
set -euo pipefail
cd "$(dirname "$0")/.."

# Oldest and newest Kubernetes versions the manifests must be valid for
# (DEPLOY_KUBE_VERSIONS overrides: the DRA variant needs 1.34+).
read -r -a KUBE_VERSIONS <<<"${DEPLOY_KUBE_VERSIONS:-1.31.0 1.37.0}"
VENV=target/ci-venv
REQUIREMENTS=deploy/requirements-ci.txt
STAMP="$VENV/.requirements-ci.txt"

fail() {
    printf 'deploy/validate.sh: %s\n' "$*" >&2
    exit 1
}

has_python() {
    python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

if ! has_python; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "installing python3 and python3-venv"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
    fi
    has_python || fail "needs python3 >= 3.11 (tomllib) with its venv module (python3-venv)"
fi

if ! cmp -s "$REQUIREMENTS" "$STAMP"; then
    echo "installing the validation tools into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --require-virtualenv \
        -r "$REQUIREMENTS" || fail "cannot install the tools of $REQUIREMENTS into $VENV"
    cp "$REQUIREMENTS" "$STAMP"
fi

if [ $# -gt 0 ]; then
    for f in "$@"; do
        [ -f "$f" ] || fail "no such file: $f"
    done
    yaml_files=("$@")
else
    mapfile -t yaml_files < <(find deploy -maxdepth 1 -name '*.yaml' | sort)
fi
objects=()
for f in "${yaml_files[@]}"; do
    case "$f" in
        deploy/kustomization.yaml | deploy/.yamllint.yaml) ;;
        *) objects+=("$f") ;;
    esac
done
[ ${#objects[@]} -gt 0 ] || fail "no Kubernetes manifests found in ${*:-deploy/}"

echo "yamllint: ${yaml_files[*]}"
"$VENV/bin/yamllint" --strict -c "${YAMLLINT_CONFIG:-deploy/.yamllint.yaml}" "${yaml_files[@]}"

for version in "${KUBE_VERSIONS[@]}"; do
    # A kind without a schema is only a warning to the tool (exit 0), so a
    # misspelt `kind:` would pass unchecked: treat that warning as an error.
    if ! out="$("$VENV/bin/kubernetes-validate" --strict -k "$version" "${objects[@]}" 2>&1)"; then
        printf '%s\n' "$out" >&2
        fail "manifests are not valid for Kubernetes $version"
    fi
    printf '%s\n' "$out"
    if grep -q "Couldn't find schema" <<<"$out"; then
        fail "an object above has no Kubernetes $version schema (misspelt kind or apiVersion?)"
    fi
done

echo "ConfigMap manifests and their DaemonSet"
"$VENV/bin/python" - "${objects[@]}" <<'PY'
"""Parses each ConfigMap's embedded devhost manifest and checks that the
DaemonSet mounts it where it reads it, probes the port it serves on, and
mounts the host folders the manifest writes to (kubelet_dir, cdi_dir,
nfd_features_dir)."""
import sys
import tomllib

import yaml

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
problems = []
configmaps = {}  # name -> {key: parsed TOML}
daemonsets = []

for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        name = doc.get("metadata", {}).get("name", "?")
        if doc.get("kind") == "ConfigMap":
            parsed = {}
            for key, text in (doc.get("data") or {}).items():
                if not key.endswith(".toml"):
                    continue
                try:
                    parsed[key] = tomllib.loads(text)
                except tomllib.TOMLDecodeError as e:
                    # Lines count from the start of the key's text.
                    problems.append(f"{path}: ConfigMap {name}, key {key} (lines counted "
                                    f"within the key): TOML: {e}")
                    parsed[key] = None
            configmaps[name] = parsed
        elif doc.get("kind") == "DaemonSet":
            daemonsets.append((path, name, doc))

for path, name, ds in daemonsets:
    where = f"{path}: DaemonSet {name}"
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        args = list(c.get("command", [])) + list(c.get("args", []))
        if "--config" not in args or args.index("--config") + 1 >= len(args):
            problems.append(f"{where}, container {c['name']}: no `--config FILE` in its args")
            continue
        config_path = args[args.index("--config") + 1]
        mounted, manifest = False, None
        for m in c.get("volumeMounts", []):
            source = volumes.get(m["name"], {}).get("configMap")
            if source is None:
                continue
            if source["name"] not in configmaps:
                problems.append(f"{where}: volume {m['name']} names ConfigMap {source['name']}, "
                                "which none of the checked files defines")
                continue
            found = configmaps[source["name"]]
            # Without `items` every key becomes a file of its own name.
            items = source.get("items") or [{"key": k, "path": k} for k in found]
            for item in items:
                if f"{m['mountPath'].rstrip('/')}/{item['path']}" != config_path:
                    continue
                mounted = True
                manifest = found.get(item["key"])
                if item["key"] not in found:
                    problems.append(f"{where}: {config_path} comes from key {item['key']} "
                                    f"of ConfigMap {source['name']}, which has no such TOML key")
        if not mounted:
            problems.append(f"{where}, container {c['name']}: --config {config_path} is not "
                            "a ConfigMap item mounted by this container")
        if manifest is None:
            # Not mounted, or already reported as missing or unparsable.
            continue
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        addr = manifest.get("metrics_addr")
        for probe_name in ("livenessProbe", "readinessProbe"):
            port = c.get(probe_name, {}).get("httpGet", {}).get("port")
            port = ports.get(port, port)
            if port is None:
                continue
            if not isinstance(port, int):
                problems.append(f"{where}: {probe_name} uses port {port!r}, not a container port")
            elif addr is None or not str(addr).endswith(f":{port}"):
                problems.append(f"{where}: {probe_name} probes port {port} but the manifest's "
                                f"metrics_addr is {addr!r}")
        # DRA resources: the API server through the pod's token, the node's
        # name, and the kubelet's plugin folders, read-write.
        if any(r.get("api") == "dra" for r in manifest.get("resource", [])):
            root = str(manifest.get("kubelet_root_dir", "/var/lib/kubelet")).rstrip("/")
            if "kubeconfig" not in manifest and pod.get("automountServiceAccountToken") is False:
                problems.append(f"{where}: the manifest has DRA resources but the pod mounts no "
                                "ServiceAccount token and the manifest names no kubeconfig")
            env = {e["name"] for e in c.get("env", [])}
            if "node_name" not in manifest and "NODE_NAME" not in env:
                problems.append(f"{where}: the manifest has DRA resources but neither node_name "
                                "nor the NODE_NAME variable")
            for sub in ("plugins", "plugins_registry"):
                if not any(m["mountPath"].rstrip("/") == f"{root}/{sub}" and not m.get("readOnly")
                           for m in c.get("volumeMounts", [])):
                    problems.append(f"{where}: the manifest has DRA resources but {root}/{sub} "
                                    "is not mounted read-write")
        kubelet_dir = manifest.get("kubelet_dir", DEFAULT_KUBELET_DIR)
        if not any(m["mountPath"] == kubelet_dir and not m.get("readOnly")
                   for m in c.get("volumeMounts", [])):
            problems.append(f"{where}: the manifest's kubelet_dir {kubelet_dir} is not mounted "
                            "read-write")
        # CDI spec files are for the node's container runtime, the NFD
        # feature file for nfd-worker: the folder must be the host's, at the
        # same path, and writable.
        for key, files, reader in (("cdi_dir", "CDI spec files", "the container runtime"),
                                   ("nfd_features_dir", "NFD feature file", "nfd-worker")):
            folder = manifest.get(key)
            if folder is None:
                continue
            folder = str(folder).rstrip("/")
            mount = next((m for m in c.get("volumeMounts", [])
                          if m["mountPath"].rstrip("/") == folder), None)
            host = (volumes.get(mount["name"], {}).get("hostPath") or {}).get("path") if mount else None
            if mount is None or mount.get("readOnly"):
                problems.append(f"{where}: the manifest's {key} {folder} is not mounted read-write: "
                                f"the {files} would stay inside the container")
            elif host is None or host.rstrip("/") != folder:
                problems.append(f"{where}: the manifest's {key} {folder} is mounted from "
                                f"{'hostPath ' + host if host else 'a volume that is no hostPath'}, "
                                f"not from the host's {folder}, where {reader} reads the {files}")

if not daemonsets:
    problems.append("no DaemonSet found in the checked files")
for p in problems:
    print(p, file=sys.stderr)
if problems:
    sys.exit(1)
print(f"OK: {len(configmaps)} ConfigMap(s), {len(daemonsets)} DaemonSet(s)")
PY

if [ $# -eq 0 ]; then
    # The DRA Component (deploy/dra/) on top of the base, as deploy/dra-render.sh
    # prints it: checked like the base, against Kubernetes 1.34+ (resource.k8s.io/v1).
    echo "== the DRA variant: deploy/dra/ on the base"
    "$VENV/bin/yamllint" --strict -c deploy/.yamllint.yaml deploy/dra/*.yaml
    mkdir -p target
    deploy/dra-render.sh >target/dra-render.yaml || fail "deploy/dra-render.sh failed (needs kubectl)"
    DEPLOY_KUBE_VERSIONS="1.34.0 1.37.0" YAMLLINT_CONFIG=deploy/helm/yamllint-rendered.yaml \
        deploy/validate.sh target/dra-render.yaml | grep -v '^INFO'
fi

echo "deploy/validate.sh: all checks passed"
