#!/usr/bin/env bash
# Prints the DRA variant of the deployment: the kustomize base in deploy/ with
# the Component deploy/dra/, through a throw-away overlay (kustomize refuses
# an overlay inside the folder of its base). Apply it with
#   deploy/dra-render.sh | kubectl apply -f -
# or name both in an overlay of your own (docs/deploy.md#dra).
set -euo pipefail
cd "$(dirname "$0")/.."
overlay=$(mktemp -d)
trap 'rm -rf "$overlay"' EXIT
# kustomize takes relative paths only.
rel=$(realpath --relative-to="$overlay" "$PWD")
cat >"$overlay/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $rel/deploy
components:
  - $rel/deploy/dra
YAML
kubectl kustomize "$overlay"
