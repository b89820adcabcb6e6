#!/usr/bin/env bash
# weave's house rules, as named checks (`scripts/check-floors.sh --list` names them; give names
# to run only those, all by default):
#   includes       a source under weave/<floor>/ includes only its own floor or floors below,
#                  parallel/'s sub-floors likewise, and no strategy includes another
#   no-circle      no circle of includes anywhere
#   functions      no function over function_limit lines
#   files          no source file over file_limit lines
#   examples-mesh  examples take their process groups from parallel::ProcessMesh
#   autograd-nodes no file outside autograd/ builds a FunctionNode (autograd::record_* do)
#   one-agreement  no code outside distributed/agreement.cpp agrees on int64 words with an
#                  all_reduce of its own (dist::agree_max is the one way)
#   architectures  no class, and no file, named for an architecture outside weave/models/ (a
#                  rotary scaling named for the model that brought it is an option, not a model)
#   layers-once    no class in weave/parallel/ whose name without "Parallel" names a class of
#                  weave/nn/ (a layer split over ranks is the nn/ layer with split leaves,
#                  nn/leaves.h), the linear leaves excepted
# The floors, lowest first (the one place they are listed):
floors=(tensor kernels autograd ops "nn optim data" distributed parallel models util)
# The communication backends (distributed/mpi, distributed/nccl) stand on tensor/ alone, plus
# the backend interface they implement and their own folder's files.
backend_allowed='^weave/(tensor/|distributed/(communicator|types)\.h)'
# parallel/ has floors of its own: core/ first, then three folders side by side that include
# core/ and themselves only, then compose/, which combines strategies (one call that wraps a
# model for the mesh's data axes). In the strategy folders no strategy includes another (a file
# <s>_*.h or .cpp belongs to strategy <s> when <s>.h is beside it), except these pairs. The
# headers left at weave/parallel/*.h only forward to their new places for one release.
parallel_floors=(core "data_parallel model_parallel checkpoint" compose)
strategy_folders="data_parallel model_parallel"
# The layers are written once, in nn/, and each strategy supplies its own leaves (nn/leaves.h);
# the models (weave/models/, a floor above) compose the strategies.
sideways_allowed=(decentralized:topology decentralized:grad_scaler)
# The linear leaves, which nn/ layers hold in place of nn::Linear, may share its name.
layers_once_allowed='^(ColumnParallelLinear|RowParallelLinear)$'
# Architectures (their model classes, files and Hugging Face options) live on the models floor,
# one folder each; the floors below hold layers any architecture may use.
architecture_names='Llama|GPT2|Mistral|Qwen'
# Functions in these folders are at most this long (signature to closing brace); every source
# file of the project is at most file_limit lines.
function_limit=80
function_folders=(weave tools)
file_limit=550
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A level
for i in "${!floors[@]}"; do
  for name in ${floors[$i]}; do level[$name]=$i; done
done

declare -A sub_level
for i in "${!parallel_floors[@]}"; do
  for name in ${parallel_floors[$i]}; do sub_level[$name]=$i; done
done

# The strategy a file of a strategy folder belongs to.
strategy_of() {
  local file=$1 stem prefix="" words word
  stem=$(basename "${file%.*}")
  IFS=_ read -ra words <<<"$stem"
  for word in "${words[@]:0:${#words[@]}-1}"; do
    prefix=${prefix:+${prefix}_}$word
    [[ -f $(dirname "$file")/$prefix.h ]] && { echo "$prefix"; return; }
  done
  echo "$stem"
}

# Checks one include inside parallel/: sub-floors, no sideways includes, no forwarders.
check_parallel_include() {
  local file=$1 line=$2 target=$3
  local from=${file#weave/parallel/} to=${target#weave/parallel/}
  if [[ $from != */* ]]; then  # a forwarding header
    return
  fi
  if [[ $to != */* ]]; then
    echo "$file:$line includes $target, which only forwards: include its new path"; return 1
  fi
  local from_floor=${from%%/*} to_floor=${to%%/*}
  [[ -n ${sub_level[$from_floor]+x} ]] || { echo "$file: folder parallel/$from_floor is not a floor of parallel/"; return 1; }
  [[ -n ${sub_level[$to_floor]+x} ]] || { echo "$file:$line includes $target, in no floor of parallel/"; return 1; }
  if ((sub_level[$to_floor] > sub_level[$from_floor])); then
    echo "$file:$line includes $target: parallel/$to_floor/ is above parallel/$from_floor/"; return 1
  elif ((sub_level[$to_floor] == sub_level[$from_floor])) && [[ $to_floor != "$from_floor" ]]; then
    echo "$file:$line includes $target: parallel/$from_floor/ and parallel/$to_floor/ stand side by side"; return 1
  elif [[ $to_floor == "$from_floor" && " $strategy_folders " == *" $from_floor "* ]]; then
    local mine theirs
    mine=$(strategy_of "$file")
    theirs=$(strategy_of "$target")
    if [[ $mine != "$theirs" && " ${sideways_allowed[*]} " != *" $mine:$theirs "* ]]; then
      echo "$file:$line includes $target: strategy '$mine' includes strategy '$theirs' (allowed pairs: ${sideways_allowed[*]})"; return 1
    fi
  fi
}

# ---- the checks (each prints what it finds and returns 1 on a finding) ----------------------

check_includes() {
  local bad=0 file floor line target target_floor
  : >"$edges"
  while IFS= read -r file; do
    floor=${file#weave/}
    floor=${floor%%/*}
    [[ -n ${level[$floor]+x} ]] || { echo "$file: folder '$floor' is not a floor in scripts/check-floors.sh"; bad=1; continue; }
    while IFS=: read -r line target; do
      target_floor=${target#weave/}
      target_floor=${target_floor%%/*}
      if [[ -z ${level[$target_floor]+x} ]]; then
        echo "$file:$line includes $target, which is in no floor"; bad=1
      elif ((level[$target_floor] > level[$floor])); then
        echo "$file:$line includes $target: $target_floor/ is above $floor/"; bad=1
      elif [[ $file =~ ^weave/distributed/(mpi|nccl)/ && ! $target =~ $backend_allowed &&
              ${target%/*} != "${file%/*}" ]]; then
        echo "$file:$line includes $target: backends may include only tensor/ and the backend interface"; bad=1
      elif [[ $floor == parallel && $target_floor == parallel ]]; then
        check_parallel_include "$file" "$line" "$target" || bad=1
      fi
      echo "$file $target" >>"$edges"
    done < <(grep -noE '^#include "weave/[^"]+"' "$file" | sed -E 's/#include "([^"]+)"/\1/')
  done < <(git ls-files 'weave/*/*' | grep -E '\.(h|cpp|cu|cuh)$')
  return $bad
}

check_no_circle() {
  [[ -s $edges ]] || check_includes >/dev/null || true
  if ! tsort "$edges" >/dev/null 2>"$edges.loop"; then
    echo "includes form a circle:"; sed 's/^/  /' "$edges.loop"; rm -f "$edges.loop"; return 1
  fi
  rm -f "$edges.loop"
}

check_functions() {
  # shellcheck disable=SC2046
  python3 scripts/check-function-length.py --limit "$function_limit" \
    $(git ls-files "${function_folders[@]/%//*}" | grep -E '\.(h|cpp|cu|cuh)$') ||
    { echo "functions longer than $function_limit lines: split them"; return 1; }
}

check_files() {
  local bad=0 lines file
  while read -r lines file; do
    [[ $file == total ]] && continue
    ((lines <= file_limit)) || { echo "$file: $lines lines (limit $file_limit): split it by role"; bad=1; }
  done < <(git ls-files | grep -E '\.(h|cpp|cu|cuh|sh|py)$' | xargs wc -l)
  return $bad
}

# Examples compose the library's axes; building process groups by hand is the library's job
# (ProcessMesh: its axes and group(axes)).
check_examples_mesh() {
  local bad=0 file line
  while IFS=: read -r file line _; do
    echo "$file:$line calls new_group: examples take their groups from parallel::ProcessMesh"; bad=1
  done < <(git ls-files 'examples/*' | grep -E '\.(h|cpp)$' | xargs grep -nE '\bnew_group\(' || true)
  return $bad
}

# Fails, listing each line with `why`, where a tracked source of weave/ other than those matching
# `allowed` has a line matching `pattern`.
forbid_in_weave() {
  local pattern=$1 allowed=$2 why=$3 found
  found=$(git ls-files 'weave/*' | grep -E '\.(h|cpp|cu)$' | grep -vE "$allowed" |
          xargs grep -nE "$pattern" || true)
  [[ -z $found ]] && return 0
  echo "$found" | sed "s|\$|  <- $why|"
  return 1
}

check_autograd_nodes() {
  forbid_in_weave '\bFunctionNode\b' '^weave/autograd/' \
    'builds a FunctionNode outside autograd/ (use autograd::record_*)'
}

check_one_agreement() {
  forbid_in_weave 'all_reduce\(.*(kInt64.*ReduceOp::Max|ReduceOp::Max.*kInt64)' \
    '^weave/distributed/agreement\.cpp$' 'agrees with an all_reduce of its own (use dist::agree_max)'
}

check_architectures() {
  local bad=0 files
  files=$(git ls-files 'weave/*' | grep -v '^weave/models/' | grep -iE "/[^/]*(${architecture_names,,})[^/]*$" || true)
  [[ -z $files ]] || { echo "$files" | sed 's|$|  <- named for an architecture: it belongs in weave/models/<arch>/|'; bad=1; }
  forbid_in_weave "^class \\w*(${architecture_names})\\w*( |$)" '^weave/models/' \
    'an architecture outside weave/models/ (one folder per architecture there)' || bad=1
  return $bad
}

# A layer that parallel/ writes again, where nn/ has it: the two would drift apart.
check_layers_once() {
  local bad=0 nn_classes class stripped
  nn_classes=$(git ls-files 'weave/nn/*' | grep -E '\.h$' | xargs grep -ohE '^class \w+' |
               awk '{print $2}' | sort -u)
  while read -r class; do
    [[ -z $class || $class =~ $layers_once_allowed ]] && continue
    stripped=${class//Parallel/}
    if [[ $stripped != "$class" ]] && grep -qx "$stripped" <<<"$nn_classes"; then
      echo "parallel::$class writes nn::$stripped again: build nn::$stripped with split leaves (nn/leaves.h)"
      bad=1
    fi
  done < <(git ls-files 'weave/parallel/*' | grep -E '\.h$' | xargs grep -ohE '^class \w+' |
           awk '{print $2}' | sort -u)
  return $bad
}

all_checks=(includes no-circle functions files examples-mesh autograd-nodes one-agreement
            architectures layers-once)
if [[ ${1:-} == --list ]]; then printf '%s\n' "${all_checks[@]}"; exit 0; fi
wanted=("$@")
((${#wanted[@]})) || wanted=("${all_checks[@]}")
edges=$(mktemp)
trap 'rm -f "$edges"' EXIT
failed=()
for name in "${wanted[@]}"; do
  [[ " ${all_checks[*]} " == *" $name "* ]] || { echo "unknown check '$name' (--list names them)"; exit 2; }
  if "check_${name//-/_}"; then
    echo "ok      $name"
  else
    echo "FAILED  $name"; failed+=("$name")
  fi
done
if ((${#failed[@]})); then
  echo "house rules: FAILED ${failed[*]} (floors, lowest first: ${floors[*]}; parallel/: ${parallel_floors[*]})"
  exit 1
fi
echo "house rules: ${wanted[*]} hold"
