#!/usr/bin/env bash
# Debian packages the Slurm and etcd tests use: slurm-wlm (slurmctld, slurmd, srun), munge,
# etcd-server and iproute2. Fast when they are there already; without root or apt-get it says so and
# those tests skip with the same reason.
set -u
need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v ip >/dev/null 2>&1 || need+=(iproute2)  # network namespaces: each test node its own address
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: not installing ${need[*]} (needs root and apt-get): the Slurm and etcd tests will skip" >&2
    exit 0
fi
echo "installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; } \
    || { echo "warning: could not install ${need[*]}: the Slurm and etcd tests will skip" >&2; exit 0; }
