// The JavaScript encoders the tokenizer tests compare with, timed on the same text as
// bench_tokenizer: js-tiktoken's r50k_base on all of it, and gpt-3-encoder (slower by orders
// of magnitude: its merge loop rebuilds objects) on its first 100 kB; median MB/s of RUNS runs.
//   node tokenizer_peer.js NPM_DIR TEXT_DIR [RUNS]
const fs = require("fs");
const path = require("path");
const [npmDir, textDir, runsArg] = process.argv.slice(2);
const runs = Number(runsArg || 5);
const modules = path.join(npmDir, "node_modules");
const { getEncoding } = require(path.join(modules, "js-tiktoken"));
const gpt3 = require(path.join(modules, "gpt-3-encoder"));
const r50k = getEncoding("r50k_base");
let text = "";
for (const name of fs.readdirSync(textDir).sort()) {
  const file = path.join(textDir, name);
  if (name.endsWith(".dat") || fs.lstatSync(file).isSymbolicLink()) continue;
  text += fs.readFileSync(file, "utf-8");
}
const median = (v) => v.sort((a, b) => a - b)[Math.floor(v.length / 2)];
const rate = (encode, sample) => {
  const rates = [];
  for (let r = 0; r < runs; ++r) {
    const start = process.hrtime.bigint();
    encode(sample);
    rates.push(Buffer.byteLength(sample) / 1e6 / (Number(process.hrtime.bigint() - start) / 1e9));
  }
  return median(rates);
};
console.log(`js-tiktoken encode_mb_per_s=${rate((t) => r50k.encode(t, [], []), text).toFixed(1)}` +
            ` gpt-3-encoder encode_mb_per_s=` +
            `${rate((t) => gpt3.encode(t), text.slice(0, 100000)).toFixed(2)}` +
            ` (median of ${runs})`);
