#!/usr/bin/env bash
# pretrained_test.sh FINETUNE WEAVE_TOKENIZE NPM_DIR MPIRUN...: the fortunes corpus through
# weave-tokenize with GPT-2's tokenizer, then a new tiny Llama (written in Hugging Face's format
# with that tokenizer) fine-tuned 100 steps at 2 ranks from the token file: a run stopped at
# step 50 and resumed from its checkpoint, and a run killed (SIGKILL, every process) once it
# logged step 50 and resumed from its last checkpoint (step 40), must print the same losses for
# every step after the resume and save the same Hugging Face files, byte for byte, as the
# uninterrupted run; tp, fsdp, context parallelism, a 2-stage pipeline, and at 4 ranks ddp x tp,
# HSDP 2 x 2, fsdp x tp x context, pipeline x context and fsdp x pipeline must end 30 steps at
# ddp's loss (float32: 1e-3 relative), and the saved model must generate from a prompt; fsdp's sampled
# generation (through its shards) and the pipeline's (the whole model put together on rank 0, no
# checkpoint written) equal one process's from the model each saved. A new tiny GPT-2 in 2 pipeline stages (its embedding tied to the last
# stage's head), alone and with 2 tensor-parallel ranks, and resumed under ddp from a pipelined
# checkpoint, ends at ddp's loss too; with --checkpoint-activations it repeats ddp's losses
# with a lower training peak. A new tiny Qwen 3, Gemma 2 and Mixtral under tp, context
# parallelism and fsdp end at ddp's loss.
# Exits 77 (skipped) without the fortunes package.
set -u
finetune=$1 tokenize=$2 npm=$3
shift 3
mpirun=("$@")
. "$(dirname "$0")/fortunes_tokens.sh"
"$finetune" --init llama --tokenizer "$gpt2" --model "$work/llama" --dim 64 --layers 2 --heads 4 \
  --kv-heads 2 --tokens "$work/fortunes.tokens" --steps 0 >/dev/null ||
  { echo "FAIL: --init"; exit 1; }
llama=(--model "$work/llama" --tokens "$work/fortunes.tokens" --context 64 --batch 4 --lr 1e-3
       --log-every 1 --checkpoint-every 20)
base=("${llama[@]}" --steps 100)
. "$(dirname "$0")/finetune_runs.sh"
run whole 2 --checkpoint "$work/ckpt_whole" --save "$work/saved_whole" --prompt "The meaning of" \
  --temperature 0 --max-new-tokens 8
run stopped 2 --checkpoint "$work/ckpt_resumed" --stop-at 50
grep -q "stopped at step 50" "$work/stopped.out" || { echo "FAIL: no stop at 50"; status=1; }
run resumed 2 --checkpoint "$work/ckpt_resumed" --resume --save "$work/saved_resumed"
grep -q "resumed at step 50" "$work/resumed.out" || { echo "FAIL: did not resume at 50"; status=1; }
steps() { grep -E "^step (5[1-9]|[6-9][0-9]|100) " "$1"; }
if [ "$(steps "$work/whole.out")" != "$(steps "$work/resumed.out")" ] || [ -z "$(steps "$work/whole.out")" ]; then
  echo "FAIL: the resumed run's losses differ"; diff <(steps "$work/whole.out") <(steps "$work/resumed.out") | head; status=1
fi
cmp -s "$work/saved_whole/model.safetensors" "$work/saved_resumed/model.safetensors" ||
  { echo "FAIL: the resumed run saved other weights"; status=1; }
grep -q "^generated: The meaning of" "$work/whole.out" || { echo "FAIL: nothing generated"; status=1; }
# Killed: the job and its ranks killed once it logged step 50, then resumed.
"${mpirun[@]}" -np 2 "$finetune" "${base[@]}" --checkpoint "$work/ckpt_killed" \
  >"$work/killed.out" 2>&1 &
job=$!
for _ in $(seq 3000); do grep -q "^step 50 " "$work/killed.out" && break; sleep 0.1; done
pkill -9 -f "ckpt_killed" 2>/dev/null
kill -9 "$job" 2>/dev/null
wait "$job" 2>/dev/null
grep -q "^step 50 " "$work/killed.out" || { echo "FAIL: the run to kill never reached step 50"; status=1; }
grep -q "^final_loss" "$work/killed.out" && { echo "FAIL: the killed run finished"; status=1; }
run after_kill 2 --checkpoint "$work/ckpt_killed" --resume --save "$work/saved_killed"
from=$(sed -n 's/^resumed at step //p' "$work/after_kill.out")
after() { awk -v from="$from" '$1 == "step" && $2 > from' "$1"; }
if [ -z "$from" ] || [ "$(after "$work/whole.out")" != "$(after "$work/after_kill.out")" ]; then
  echo "FAIL: after the kill, resumed at step '${from}', the losses differ"; status=1
fi
cmp -s "$work/saved_whole/model.safetensors" "$work/saved_killed/model.safetensors" ||
  { echo "FAIL: the run resumed after the kill saved other weights"; status=1; }
echo "killed after step 50, resumed at step $from"
echo "ddp final_loss=$(final whole); resumed: $(final resumed)"
# Every strategy from the same checkpoint and batches: the same loss after 30 steps as ddp's.
# GPT-2's vocabulary (50257) is padded under tp (50304), its padding masked.
base=("${llama[@]}" --steps 30)
run ddp_30 2
reference=$(final ddp_30)
for case in "tp 2 --strategy tp" \
            "fsdp 2 --strategy fsdp --save $work/saved_fsdp --prompt Once --temperature 1.5 --top-p 1 --max-new-tokens 16" \
            "context 2 --context-parallel 2" \
            "pipeline 2 --pipeline 2 --save $work/saved_pipeline --prompt Once --temperature 1.5 --top-p 1 --max-new-tokens 16" \
            "hybrid 4 --strategy hybrid --tp 2" "hsdp 4 --strategy fsdp --replicate 2" \
            "fsdp_tp_context 4 --strategy fsdp --tp 2 --context-parallel 2" \
            "tp_pipeline_context 4 --strategy tp --pipeline 2 --context-parallel 2" \
            "fsdp_pipeline 4 --strategy fsdp --pipeline 2 --microbatches 2"; do
  read -r name ranks args <<<"$case"
  # shellcheck disable=SC2086
  run "$name" "$ranks" $args
  agrees "$name"
done
# fsdp decodes through its shards, each block gathered in turn (no rank builds the whole model):
# sampled from the same seed, the tokens one process samples from the model that run saved.
# A pipelined run decodes with the whole model put together on rank 0 from the stages (no
# checkpoint written for it): the tokens one process samples from the model that run saved.
for layout in fsdp pipeline; do
  "${mpirun[@]}" -np 1 "$finetune" --model "$work/saved_$layout" --tokens "$work/fortunes.tokens" \
    --steps 0 --prompt Once --temperature 1.5 --top-p 1 --max-new-tokens 16 \
    >"$work/${layout}_reload.out" 2>&1 || { echo "FAIL: ${layout}_reload"; status=1; }
  sampled=$(grep '^generated:' "$work/$layout.out") saved=$(grep '^generated:' "$work/${layout}_reload.out")
  [ -n "$sampled" ] && [ "$sampled" = "$saved" ] ||
    { echo "FAIL: $layout generated '$sampled', its saved model '$saved'"; status=1; }
  echo "$layout $sampled"
done
[ ! -e "$work/saved_pipeline/.stages" ] || { echo "FAIL: a checkpoint was written to decode"; status=1; }
# GPT-2 in pipeline stages, its token embedding tied to the last stage's head: the 2-stage run
# and 2 stages x 2 tensor-parallel ranks end at ddp's loss; a pipelined run stopped at step 20
# resumes under ddp (both stages saved the embedding) to ddp's loss; the export holds one wte.
"$finetune" --init gpt2 --tokenizer "$gpt2" --model "$work/gpt2" --dim 64 --layers 2 --heads 4 \
  --tokens "$work/fortunes.tokens" --steps 0 >/dev/null || { echo "FAIL: --init gpt2"; exit 1; }
base=(--model "$work/gpt2" --tokens "$work/fortunes.tokens" --steps 40 --context 64 --batch 4
      --lr 1e-3 --log-every 1 --checkpoint-every 20)
run gpt2_ddp 2
reference=$(final gpt2_ddp)
# Recomputing every block in backward (the loaded model's set_recompute_blocks) repeats each
# step's loss to the last printed digit, with a lower training peak (exact byte counts).
run gpt2_recompute 2 --checkpoint-activations
[ -n "$(grep '^step' "$work/gpt2_ddp.out")" ] &&
  [ "$(grep '^step' "$work/gpt2_recompute.out")" = "$(grep '^step' "$work/gpt2_ddp.out")" ] ||
  { echo "FAIL: --checkpoint-activations changed the losses"; status=1; }
peak() { sed -n 's/^training_peak_bytes=//p' "$work/$1.out"; }
[ -n "$(peak gpt2_ddp)" ] && [ -n "$(peak gpt2_recompute)" ] &&
  [ "$(peak gpt2_recompute)" -lt "$(peak gpt2_ddp)" ] ||
  { echo "FAIL: --checkpoint-activations peak $(peak gpt2_recompute) B, ddp's $(peak gpt2_ddp) B"
    status=1; }
echo "training peak: $(peak gpt2_ddp) B, with --checkpoint-activations $(peak gpt2_recompute) B"
run gpt2_pipeline 2 --pipeline 2 --save "$work/gpt2_saved"
run gpt2_pipeline_tp 4 --strategy tp --pipeline 2
run gpt2_stopped 2 --pipeline 2 --checkpoint "$work/ckpt_gpt2" --stop-at 20
run gpt2_resumed 2 --checkpoint "$work/ckpt_gpt2" --resume
for name in gpt2_pipeline gpt2_pipeline_tp gpt2_resumed; do agrees "$name"; done
[ "$(grep -ao '"transformer.wte.weight"' "$work/gpt2_saved/model.safetensors" | wc -l)" -eq 1 ] ||
  { echo "FAIL: the pipelined GPT-2's export does not hold exactly one wte"; status=1; }
# new_model_agrees NAME INIT_FLAGS...: a new tiny model (finetune INIT_FLAGS) trained 20 steps
# under ddp, tp, context parallelism and fsdp; each ends at ddp's loss, and ddp's export is in
# $work/NAME_saved.
new_model_agrees() {
  local name=$1
  shift
  "$finetune" "$@" --tokenizer "$gpt2" --model "$work/$name" --dim 64 --layers 2 --heads 4 \
    --kv-heads 2 --tokens "$work/fortunes.tokens" --steps 0 >/dev/null ||
    { echo "FAIL: $*"; exit 1; }
  base=(--model "$work/$name" --tokens "$work/fortunes.tokens" --steps 20 --context 64 --batch 4
        --lr 1e-3 --log-every 1 --checkpoint-every 20)
  run "${name}_ddp" 2 --save "$work/${name}_saved"
  reference=$(final "${name}_ddp")
  run "${name}_tp" 2 --strategy tp
  run "${name}_cp" 2 --context-parallel 2
  run "${name}_fsdp" 2 --strategy fsdp
  for strategy in tp cp fsdp; do agrees "${name}_$strategy"; done
}
# A new Qwen 3 (q/k norms; head_dim 32, twice dim / heads): its export says qwen3 and holds the
# norms.
new_model_agrees qwen3 --init qwen3 --head-dim 32
grep -q '"model_type": "qwen3"' "$work/qwen3_saved/config.json" &&
  grep -aq '"model.layers.1.self_attn.k_norm.weight"' "$work/qwen3_saved/model.safetensors" ||
  { echo "FAIL: the Qwen 3 export is not a Qwen 3 checkpoint"; status=1; }
# A new Gemma 2 (soft-caps, (1 + w) norms before and after attention and MLP, a tied head; a
# window of 8 on its local layer, which reaches across the context-parallel ranks' 16-position
# chunks).
new_model_agrees gemma2 --init gemma2 --head-dim 32 --window 8
grep -q '"model_type": "gemma2"' "$work/gemma2_saved/config.json" &&
  grep -q '"attn_logit_softcapping": 50' "$work/gemma2_saved/config.json" ||
  { echo "FAIL: the Gemma 2 export is not a Gemma 2 checkpoint"; status=1; }
# A new Mixtral (4 SwiGLU experts a block, 2 a token, the experts whole on every rank).
new_model_agrees mixtral --init mixtral --experts 4 --experts-per-token 2
grep -q '"num_local_experts": 4' "$work/mixtral_saved/config.json" &&
  grep -aq '"model.layers.1.block_sparse_moe.experts.3.w2.weight"' \
    "$work/mixtral_saved/model.safetensors" ||
  { echo "FAIL: the Mixtral export is not a Mixtral checkpoint"; status=1; }
[ "$status" -eq 0 ] && echo "PASS: fine-tuning resumes exactly and every strategy agrees"
exit "$status"
