#!/usr/bin/env bash
# Checks of the Helm chart in deploy/helm/devhost, run by .ci/run and by hand
# (`deploy/helm/check.sh` from anywhere in the repository):
#   0. yamllint on the chart's YAML files;
#   1. `helm lint --strict` with the default values and with every
#      deploy/helm/devhost/ci/*-values.yaml;
#   2. `helm template` of each, checked by deploy/validate.sh (yamllint, the
#      Kubernetes API schemas, the embedded manifest against the DaemonSet);
#      a ServiceMonitor (a CRD, without a schema there) is checked here;
#   3. with the default values the chart renders the same ServiceAccount,
#      ConfigMap manifest and DaemonSet as the kustomize base in deploy/
#      (`kubectl kustomize`), Helm's bookkeeping labels aside;
#   4. what the ci values promise: CDI and node affinity on by default and
#      off when switched off, the ServiceMonitor's selector, DRA off by
#      default and complete when on (ci/dra-values.yaml); and that
#      values.schema.json refuses misspelt and mistyped values.
# helm is the real one, built from its Go module at HELM_VERSION (needs Go;
# the binary is cached in ~/.cache/devhost-helm/<version>/, so only the first
# run builds it). kubectl must have kustomize built in (kubectl 1.14+).
set -euo pipefail
cd "$(dirname "$0")/../.."

HELM_VERSION=${HELM_VERSION:-v4.3.1}
HELM_MODULE=helm.sh/helm/v${HELM_VERSION:1:1}
HELM_DIR=${DEVHOST_HELM_CACHE:-$HOME/.cache/devhost-helm}/$HELM_VERSION
HELM=$HELM_DIR/helm
CHART=deploy/helm/devhost
OUT=target/helm-render
VENV=target/ci-venv

fail() {
    printf 'deploy/helm/check.sh: %s\n' "$*" >&2
    exit 1
}

if [ ! -x "$HELM" ]; then
    command -v go >/dev/null || fail "needs Go to build helm $HELM_VERSION (or put a helm binary at $HELM)"
    echo "building helm $HELM_VERSION from $HELM_MODULE (once; cached in $HELM_DIR)"
    start=$(date +%s)
    mkdir -p "$HELM_DIR"
    GOBIN="$HELM_DIR" go install -trimpath \
        -ldflags "-s -w -X $HELM_MODULE/internal/version.version=$HELM_VERSION" \
        "$HELM_MODULE/cmd/helm@$HELM_VERSION" || fail "cannot build helm $HELM_VERSION"
    echo "built helm in $(($(date +%s) - start)) s"
fi
"$HELM" version --short

rm -rf "$OUT"
mkdir -p "$OUT"
renders=(default)
values_args=("")
for f in "$CHART"/ci/*-values.yaml; do
    [ -e "$f" ] || continue
    name=$(basename "$f" -values.yaml)
    renders+=("$name")
    values_args+=("$f")
done

# The chart's own YAML files (not the templates, which are not YAML until
# rendered) follow deploy/'s style; validate.sh installs yamllint first.
[ -x "$VENV/bin/yamllint" ] || deploy/validate.sh >/dev/null
echo "== yamllint: the chart's YAML files"
"$VENV/bin/yamllint" --strict -c deploy/.yamllint.yaml "$CHART/Chart.yaml" "$CHART/values.yaml" \
    "$CHART"/ci/*.yaml deploy/helm/yamllint-rendered.yaml

for i in "${!renders[@]}"; do
    name=${renders[$i]}
    args=()
    [ -n "${values_args[$i]}" ] && args=(-f "${values_args[$i]}")
    echo "== helm lint, helm template: $name values"
    "$HELM" lint --strict "$CHART" "${args[@]}"
    "$HELM" template devhost "$CHART" --namespace kube-system "${args[@]}" >"$OUT/$name.yaml"
done

# values.schema.json turns a misspelt or mistyped value into an error that
# names it, instead of a value silently ignored.
echo "== values.schema.json refuses bad values"
for bad in "affinty=x|additional properties 'affinty' not allowed" \
    "metrics.port=70000|/metrics/port" "cdi.enabled=maybe|/cdi/enabled"; do
    if out=$("$HELM" template devhost "$CHART" --set "${bad%%|*}" 2>&1); then
        fail "helm template --set ${bad%%|*} was accepted"
    fi
    grep -qF -- "${bad#*|}" <<<"$out" || fail "helm template --set ${bad%%|*} failed without naming it: $out"
done

echo "== kubectl kustomize deploy/"
kubectl kustomize deploy/ >"$OUT/kustomize.yaml" || fail "kubectl kustomize deploy/ failed"

# deploy/validate.sh installs the venv on its first run; the ServiceMonitor
# documents go to their own file first, since they have no schema there.
export YAMLLINT_CONFIG=deploy/helm/yamllint-rendered.yaml
deploy/validate.sh "$OUT/default.yaml" >/dev/null || fail "the default render fails deploy/validate.sh (run it on $OUT/default.yaml)"
"$VENV/bin/python" - "$OUT" "${renders[@]}" <<'PY'
import sys
import yaml

out, names = sys.argv[1], sys.argv[2:]
for name in names:
    with open(f"{out}/{name}.yaml", encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    crds = [d for d in docs if d["kind"] == "ServiceMonitor"]
    rest = [d for d in docs if d["kind"] != "ServiceMonitor"]
    with open(f"{out}/{name}.objects.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump_all(rest, f, sort_keys=False, explicit_start=True)
    with open(f"{out}/{name}.crds.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump_all(crds, f, sort_keys=False, explicit_start=True)
PY
for name in "${renders[@]}"; do
    echo "== deploy/validate.sh: $name render"
    # DRA objects (resource.k8s.io/v1) exist from Kubernetes 1.34.
    versions="1.31.0 1.37.0"
    [[ $name == dra* ]] && versions="1.34.0 1.37.0"
    DEPLOY_KUBE_VERSIONS=$versions deploy/validate.sh "$OUT/$name.objects.yaml" | grep -v '^INFO'
done

echo "== the chart against the kustomize base, and what the ci values promise"
"$VENV/bin/python" - "$OUT" "${renders[@]}" <<'PY'
import copy
import json
import sys
import tomllib

import yaml

out, names = sys.argv[1], sys.argv[2:]
problems = []

# Labels Helm charts carry for Helm's own bookkeeping; the kustomize base has
# no release to name.
HELM_LABELS = {"app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
               "app.kubernetes.io/version", "helm.sh/chart"}


def load(name):
    with open(f"{out}/{name}.yaml", encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def strip_helm(obj):
    """Drops Helm's bookkeeping labels wherever labels are listed."""
    obj = copy.deepcopy(obj)

    def walk(node):
        if isinstance(node, dict):
            for key in ("labels", "matchLabels"):
                if isinstance(node.get(key), dict):
                    for label in HELM_LABELS:
                        node[key].pop(label, None)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(obj)
    return obj


def diff(a, b, path=""):
    """The paths where two objects differ, for a readable failure."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a:
                found.append(f"{path}.{key}: only in the chart")
            elif key not in b:
                found.append(f"{path}.{key}: only in kustomize")
            else:
                found += diff(a[key], b[key], f"{path}.{key}")
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if a != b:
        return [f"{path}: kustomize {json.dumps(a)}, chart {json.dumps(b)}"]
    return []


def daemonset(docs):
    found = find(docs, "DaemonSet")
    return found[0] if len(found) == 1 else None


def pod(ds):
    return ds["spec"]["template"]["spec"]


def manifest(docs):
    return tomllib.loads(find(docs, "ConfigMap")[0]["data"]["devhost.toml"])


def mounts(ds):
    return {m["mountPath"]: m for m in pod(ds)["containers"][0]["volumeMounts"]}


kustomize, chart = load("kustomize"), load("default")

# 3. The same objects for the default values.
for kind in ("ServiceAccount", "DaemonSet"):
    k, c = find(kustomize, kind), [strip_helm(d) for d in find(chart, kind)]
    if len(k) != 1 or len(c) != 1:
        problems.append(f"{kind}: kustomize renders {len(k)}, the chart {len(c)}")
        continue
    for d in diff(strip_helm(k[0]), c[0], kind):
        problems.append(f"{kind} differs at {d}")
k_cm, c_cm = find(kustomize, "ConfigMap")[0], find(chart, "ConfigMap")[0]
if strip_helm(k_cm)["metadata"] != strip_helm(c_cm)["metadata"]:
    problems.append(f"ConfigMap metadata differs: {diff(k_cm['metadata'], strip_helm(c_cm)['metadata'])}")
for d in diff(manifest(kustomize), manifest(chart), "devhost.toml"):
    problems.append(f"the ConfigMap's manifest differs at {d}")

# 4. CDI mounted and set by default (both renders), node affinity on by default.
for name, docs in (("kustomize", kustomize), ("chart", chart)):
    ds = daemonset(docs)
    cdi = manifest(docs).get("cdi_dir")
    if cdi != "/var/run/cdi":
        problems.append(f"{name}: the manifest's cdi_dir is {cdi!r}, not /var/run/cdi")
    m = mounts(ds).get("/var/run/cdi")
    if m is None or m.get("readOnly"):
        problems.append(f"{name}: /var/run/cdi is not mounted read-write")
    terms = (pod(ds).get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
    keys = {e["key"] for t in terms for e in t.get("matchExpressions", [])}
    for key in ("feature.node.kubernetes.io/pci-10de.present", "devhost/enabled"):
        if key not in keys:
            problems.append(f"{name}: the default node affinity has no term for {key}")
    if any(len(t.get("matchExpressions", [])) != 1 for t in terms):
        problems.append(f"{name}: a node affinity term has more than one expression (they must be ORed)")

renders = {n: load(n) for n in names}
if "plain" in renders:
    ds = daemonset(renders["plain"])
    if "affinity" in pod(ds):
        problems.append("plain values (affinity: null): the DaemonSet still has an affinity")
    if "cdi_dir" in manifest(renders["plain"]) or "/var/run/cdi" in mounts(ds):
        problems.append("plain values (cdi.enabled: false): CDI is still set or mounted")
    if "/var/lib/kubelet/pod-resources" in mounts(ds):
        problems.append("plain values (podResources.enabled: false): pod-resources is still mounted")
if "full" in renders:
    docs = renders["full"]
    monitors, services = find(docs, "ServiceMonitor"), find(docs, "Service")
    if len(monitors) != 1 or len(services) != 1:
        problems.append(f"full values: {len(monitors)} ServiceMonitor(s), {len(services)} Service(s), "
                        "expected one each")
    else:
        sm, svc = monitors[0], services[0]
        if sm["apiVersion"] != "monitoring.coreos.com/v1":
            problems.append(f"full values: ServiceMonitor apiVersion {sm['apiVersion']}")
        selector = sm["spec"]["selector"]["matchLabels"]
        if any(svc["metadata"]["labels"].get(k) != v for k, v in selector.items()):
            problems.append(f"full values: the ServiceMonitor selects {selector}, "
                            f"not the Service's labels {svc['metadata']['labels']}")
        ports = {p["name"] for p in svc["spec"]["ports"]}
        for e in sm["spec"]["endpoints"]:
            if e["port"] not in ports:
                problems.append(f"full values: ServiceMonitor endpoint port {e['port']} is not a Service port")
            if e.get("path") != "/metrics":
                problems.append(f"full values: ServiceMonitor scrapes {e.get('path')}, not /metrics")
        ds = daemonset(docs)
        if svc["spec"]["selector"] != ds["spec"]["selector"]["matchLabels"]:
            problems.append("full values: the Service does not select the DaemonSet's pods")

# DRA: off by default (no API rights, no token); on, the rights, the
# DeviceClasses and the token (the mounts and NODE_NAME: deploy/validate.sh).
for kind in ("ClusterRole", "ClusterRoleBinding", "DeviceClass", "ValidatingAdmissionPolicy"):
    if find(chart, kind):
        problems.append(f"default values: the chart renders a {kind}, but dra.enabled is off")
if pod(daemonset(chart)).get("automountServiceAccountToken") is not False:
    problems.append("default values: the pod mounts a ServiceAccount token without DRA")
if "dra" in renders:
    docs = renders["dra"]
    classes = {d["metadata"]["name"]: d["spec"] for d in find(docs, "DeviceClass")}
    gpu = classes.get("gpu.nvidia.com", {})
    if gpu.get("extendedResourceName") != "nvidia.com/gpu":
        problems.append(f"dra values: DeviceClass gpu.nvidia.com is {gpu}")
    rules = [r for d in find(docs, "ClusterRole") for r in d["rules"]]
    if not any("resourceslices" in r["resources"] and "watch" in r["verbs"] for r in rules):
        problems.append(f"dra values: no ClusterRole rule lets devhost watch resourceslices: {rules}")
    if len(find(docs, "ValidatingAdmissionPolicy")) != 1:
        problems.append("dra values: no ValidatingAdmissionPolicy")
    sa = find(docs, "ServiceAccount")[0]
    if sa.get("automountServiceAccountToken") is not True or \
            pod(daemonset(docs)).get("automountServiceAccountToken") is not True:
        problems.append("dra values: the ServiceAccount token is not mounted")
    if manifest(docs).get("kubelet_root_dir") != "/var/lib/k0s/kubelet":
        problems.append("dra values: the manifest's kubelet_root_dir is not dra.kubeletRootDir")

for p in problems:
    print(p, file=sys.stderr)
if problems:
    sys.exit(1)
print(f"OK: the chart's defaults match the kustomize base; {len(names)} render(s) checked")
PY
echo "deploy/helm/check.sh: all checks passed"
