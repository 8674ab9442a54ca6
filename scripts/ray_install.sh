#!/usr/bin/env bash
# Install the Ray payload that scripts/ray_payload.sh wrote (.carry/ray, and the server's wheels in
# .carry/whl) on the GPU machine, which has neither Ray nor a network. Source it at the start of a device
# command; it exports PYTHONPATH with the install in front (run with bash, it prints that export line):
#
#   source scripts/ray_install.sh          # RAY_CARRY=.carry RAY_SITE=/tmp/ray-site by default
#
# The wheels go in with pip --no-index --no-deps --target, then ray.tar.xz is unpacked beside them (by
# Python's tarfile: no xz binary needed), all in RAY_SITE.tmp, renamed to RAY_SITE once complete: a second
# call finds RAY_SITE and only exports.
ray_install() {
  local carry=${RAY_CARRY:-.carry} site=${RAY_SITE:-/tmp/ray-site}
  if [ ! -d "$site" ]; then
    if [ ! -f "$carry/ray/ray.tar.xz" ]; then
      echo "ray_install: no $carry/ray/ray.tar.xz; make it with scripts/ray_payload.sh and carry .carry" >&2
      return 1
    fi
    rm -rf "$site.tmp"
    python -m pip install -q --no-index --no-deps --no-compile --target "$site.tmp" \
        "$carry"/ray/whl/*.whl "$carry"/whl/*.whl &&
      python -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" \
        "$carry/ray/ray.tar.xz" "$site.tmp" &&
      mv "$site.tmp" "$site" || { echo "ray_install: installing into $site failed" >&2; return 1; }
  fi
  case ":${PYTHONPATH:-}:" in
    *":$site:"*) ;;
    *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
}
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -e
  ray_install
  echo "export PYTHONPATH=$PYTHONPATH"
else
  ray_install
fi
