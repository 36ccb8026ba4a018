#!/usr/bin/env bash
# `make docker-test` (by hand; too long for CI): build docker/Dockerfile as a CPU image
# (GPU_STACK=0) on a Debian bookworm base made locally with debootstrap, run the CPU quickstart
# in it with podman, and check that the run reached its last step with a validation reward.
#
#   tools/docker_test.sh [build|run|all]     # default: all
#
# Needs root and Debian's podman, buildah, runc and debootstrap
# (`apt-get install podman buildah runc debootstrap`), Debian's mirror, and PyPI or the package
# sources of this machine's pip configuration: local wheel directories and file:// indexes named
# by PIP_FIND_LINKS / PIP_INDEX_URL / PIP_EXTRA_INDEX_URL or `pip config` are mounted read-only
# into the build and passed as build arguments (the Dockerfile itself names no host path).
#
# Environment:
#   RLHF_DOCKER_CACHE  the debootstrap tarball, build log and the container's runs/
#                      (default ~/.cache/rlhf-docker); reruns reuse the tarball, the imported
#                      base image and buildah's layer cache
#   IMAGE              the image to build and run (default localhost/rlhf:cpu)
#   CONTEXT            a directory to build as it is; by default a snapshot of this checkout
#                      (tracked and untracked files git does not ignore) taken when the build
#                      starts, so edits made during the long build do not mix into it
#   RUNTIME            OCI runtime (default /usr/sbin/runc: crun, podman's default here, cannot
#                      set its default rlimits without CAP_SYS_RESOURCE)
#   DEBIAN_MIRROR      (default http://deb.debian.org/debian)
#   PYTHON             the python whose pip configuration is copied (default python3)
#   MIN_FREE_GB        free disk the build insists on (default 35)
set -euo pipefail

cd "$(dirname "$0")/.."
what=${1:-all}
case $what in build | run | all) ;; *)
    echo "usage: $0 [build|run|all]" >&2
    exit 2
    ;;
esac

cache=${RLHF_DOCKER_CACHE:-$HOME/.cache/rlhf-docker}
image=${IMAGE:-localhost/rlhf:cpu}
runtime=${RUNTIME:-/usr/sbin/runc}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
python=${PYTHON:-python3}
base=local/debian-base:bookworm
tarball=$cache/debian-bookworm-minbase.tar
# podman's and buildah's default rlimits exceed the hard limits of a sandboxed host; these fit.
limits=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
# heavy steps yield to whatever else the machine runs
low=(nice -n 19 ionice -c3)
mkdir -p "$cache"

for tool in podman buildah debootstrap "$runtime"; do
    command -v "$tool" >/dev/null || {
        echo "$tool not found: apt-get install podman buildah runc debootstrap" >&2
        exit 1
    }
done

log() { printf '[docker-test] %s\n' "$*"; }

# --- the base image: a minimal Debian bookworm rootfs, made once -------------------------------
make_base() {
    if podman image exists "$base"; then
        log "base image $base exists"
        return
    fi
    if [[ ! -f $tarball ]]; then
        local rootfs=$cache/rootfs.tmp start=$SECONDS
        rm -rf "$rootfs"
        "${low[@]}" debootstrap --variant=minbase bookworm "$rootfs" "$mirror" \
            >"$cache/debootstrap.log" 2>&1 || {
            tail -20 "$cache/debootstrap.log" >&2
            exit 1
        }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        "${low[@]}" tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        rm -rf "$rootfs"
        log "debootstrap bookworm: $((SECONDS - start)) s, $(du -h "$tarball" | cut -f1) tarball"
    fi
    podman import "$tarball" "$base" >/dev/null
    log "imported $tarball as $base"
}

# --- pip's package sources of this machine, for the build ----------------------------------------
pip_setting() { # env var, else pip's configuration (global, then user files)
    local env_name=$1 key=$2
    if [[ -n ${!env_name:-} ]]; then
        printf '%s\n' "${!env_name}"
    else
        "$python" -m pip config get "global.$key" 2>/dev/null || true
    fi
}

pip_build_args=()
pip_volumes=()
add_volume() {
    local dir=$1
    [[ -d $dir ]] || return 0
    local existing
    for existing in "${pip_volumes[@]}"; do
        [[ $existing == "--volume=$dir:$dir:ro" ]] && return 0
    done
    pip_volumes+=("--volume=$dir:$dir:ro")
}

collect_pip_sources() {
    local env_name key value item path
    for env_name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
        key=${env_name#PIP_}
        key=${key,,}
        key=${key//_/-}
        value=$(pip_setting "$env_name" "$key" | tr '\n' ' ')
        value=${value%" "}
        [[ -n $value ]] || continue
        pip_build_args+=(--build-arg "$env_name=$value")
        for item in $value; do
            path=${item#file://}
            if [[ $path == /* ]]; then
                # a PEP 503 index links to ../../files/...: mount the directory above simple/
                [[ ${path%/} == */simple ]] && path=$(dirname "${path%/}")
                add_volume "$path"
            fi
        done
    done
    # a CA bundle pip needs here (a TLS-intercepting proxy) goes in beside the image's own
    local cert
    cert=$(pip_setting PIP_CERT cert)
    if [[ -f $cert ]]; then
        pip_build_args+=(--build-arg "PIP_CERT=/run/pip-cert.pem")
        pip_volumes+=("--volume=$cert:/run/pip-cert.pem:ro")
    fi
    log "pip sources: ${pip_build_args[*]:-PyPI} ${pip_volumes[*]}"
}

# --- the CPU image ---------------------------------------------------------------------------
snapshot_checkout() {
    local snap=$cache/context
    rm -rf "$snap"
    mkdir -p "$snap"
    git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' file; do
            if [[ -e $file || -L $file ]]; then printf '%s\0' "$file"; fi
        done | tar --null -T - -cf - | tar -xf - -C "$snap"
    context=$snap
}

build_image() {
    # the runtime stage's copy of the ~7.5 GB venv needs about three times that while buildah
    # commits it (the layer, its temporary copies in /var/tmp and the storage)
    local free_gb
    free_gb=$(df -BG --output=avail /var/lib/containers/storage /var/tmp 2>/dev/null |
        tail -n +2 | tr -d 'G ' | sort -n | head -1)
    if [[ -n $free_gb && $free_gb -lt ${MIN_FREE_GB:-35} ]]; then
        echo "only ${free_gb} GB free for the build; it needs about 35 (MIN_FREE_GB)" >&2
        exit 1
    fi
    make_base
    collect_pip_sources
    context=${CONTEXT:-}
    [[ -n $context ]] || snapshot_checkout
    local start=$SECONDS
    log "building $image from $context (log: $cache/build.log)"
    # the build log keeps everything; the terminal shows the steps and what GPU_STACK=0 skips
    if ! "${low[@]}" buildah build --format docker --layers --force-rm \
        --runtime "$runtime" "${limits[@]}" \
        --network host \
        --build-arg BASE_IMAGE="$base" --build-arg GPU_STACK=0 \
        "${pip_build_args[@]}" "${pip_volumes[@]}" \
        -f "$context/docker/Dockerfile" -t "$image" "$context" 2>&1 | tee "$cache/build.log" |
        { grep --line-buffered -E 'STEP [0-9]|^GPU_STACK|^Successfully' || true; }; then
        echo "buildah build failed; the end of $cache/build.log:" >&2
        tail -30 "$cache/build.log" >&2
        exit 1
    fi
    log "image build: $((SECONDS - start)) s"
    log "image size: $(podman image inspect --format '{{.Size}}' "$image" |
        awk '{printf "%.2f GB", $1 / 1e9}')"
}

# --- the CPU quickstart in the container -----------------------------------------------------
run_quickstart() {
    local runs=$cache/runs start=$SECONDS
    rm -rf "$runs/quickstart" # a fresh run, not a resume at its last step
    mkdir -p "$runs"
    log "quickstart in $image (runs/ is $runs)"
    # podman's own network namespace (the trainer and its SGLang server talk over the
    # container's loopback, clear of the host's ports) and its 64 MB /dev/shm suffice on CPU
    # shellcheck disable=SC2016 # the container's shell expands $SECONDS
    if ! "${low[@]}" podman run --rm --runtime "$runtime" "${limits[@]}" \
        -v "$runs:/opt/rlhf/runs" "$image" bash -ec '
            rlhf-make-tiny-model runs/quickstart/model --warm-start
            rlhf-preprocess quickstart --local_dir runs/quickstart/data
            start=$SECONDS
            rlhf-train --config configs/quickstart_cpu.yaml
            echo "rlhf-train: $((SECONDS - start)) s"
            rlhf-plot runs/quickstart' 2>&1 | tee "$cache/quickstart.log"; then
        echo "the quickstart failed in the container (log: $cache/quickstart.log)" >&2
        exit 1
    fi
    log "quickstart in the container: $((SECONDS - start)) s"
    "$python" - "$runs/quickstart/metrics.jsonl" configs/quickstart_cpu.yaml <<'EOF'
import json
import re
import sys

KEY = "val-core/arithmetic/reward/mean@4"
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = int(re.search(r"total_training_steps:\s*(\d+)", open(sys.argv[2]).read()).group(1))
rewards = [row[KEY] for row in rows if KEY in row]
if rows[-1].get("step") != steps or KEY not in rows[-1]:
    sys.exit(f"[docker-test] FAILED: the last row has step {rows[-1].get('step')} of {steps}"
             f" and {KEY} {rows[-1].get(KEY)}")
print(f"[docker-test] OK: step {steps}/{steps}, validation reward"
      f" {rewards[0]:.3f} -> {rewards[-1]:.3f}")
EOF
}

case $what in
build) build_image ;;
run) run_quickstart ;;
all)
    build_image
    run_quickstart
    ;;
esac
