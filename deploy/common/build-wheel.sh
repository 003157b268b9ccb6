#!/usr/bin/env bash
# build_wheel (sourced by deploy/*/deploy.sh): the elasticyolo wheel of the committed tree at $ROOT
# (git archive: no uncommitted edit and no stale build/ file goes to the nodes), named as
# ELASTICYOLO_WHEEL names it (pip reads a wheel's version and tags from its file name). Prints
# the wheel's path.
build_wheel() {
  local src out built
  src=$(mktemp -d) && out=$(mktemp -d) || return 1
  git -C "$ROOT" archive HEAD | tar -x -C "$src" || return 1
  python3 -m pip wheel --quiet --no-deps -w "$out" "$src" >&2 || return 1
  built=$(ls "$out"/elasticyolo-*.whl) || return 1
  if [ "${built##*/}" != "${ELASTICYOLO_WHEEL##*/}" ]; then
    echo "built ${built##*/}, but ELASTICYOLO_WHEEL names ${ELASTICYOLO_WHEEL##*/}: set it to .../${built##*/}" >&2
    return 1
  fi
  rm -rf "$src"
  printf '%s\n' "$built"
}
