// The reference side of the tokenizer tests: GPT-2's published encoders (npm's gpt-3-encoder and
// js-tiktoken's r50k_base) on every line and every fortune of the fortunes corpus and on the
// hard cases, and the pieces GPT-2's and Llama 3's split patterns cut them into, as JSON for
// tests/unit/test_tokenizer.cpp. Only the tests run node; weave never does.
//   node bpe_reference.js NPM_DIR FORTUNES_DIR HARD_CASES_JSON OUT_JSON
const fs = require("fs");
const path = require("path");
const [npmDir, fortunesDir, hardCasesFile, outFile] = process.argv.slice(2);
const modules = path.join(npmDir, "node_modules");
const gpt3 = require(path.join(modules, "gpt-3-encoder"));
const { getEncoding } = require(path.join(modules, "js-tiktoken"));
const r50k = getEncoding("r50k_base");

const texts = [];
for (const name of fs.readdirSync(fortunesDir).sort()) {
  const file = path.join(fortunesDir, name);
  if (name.endsWith(".dat") || fs.lstatSync(file).isSymbolicLink() || !fs.statSync(file).isFile())
    continue;
  const content = fs.readFileSync(file, "utf-8");
  for (const line of content.split("\n")) texts.push(line + "\n");
  for (const fortune of content.split("\n%\n")) texts.push(fortune);
}
const corpusTexts = texts.length;
texts.push(...JSON.parse(fs.readFileSync(hardCasesFile, "utf-8")));

const gpt2Pattern = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;
// Llama 3's (?i:'s|...) spelled out for node's regular expressions, which lack inline flags;
// U+017F (long s) folds to s.
const llama3Pattern = new RegExp(
    "'(?:[sS\u017F]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" +
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+", "gu");
const pieces = (pattern, text) => Array.from(text.matchAll(pattern), (m) => m[0]);

const out = {corpus_texts: corpusTexts, texts, gpt3: [], r50k: [], r50k_special: [], gpt2_pieces: [], llama3_pieces: []};
for (const text of texts) {
  out.gpt3.push(gpt3.encode(text));
  out.r50k.push(r50k.encode(text, [], []));  // special tokens' text is ordinary text
  out.r50k_special.push(r50k.encode(text, "all"));
  out.gpt2_pieces.push(pieces(gpt2Pattern, text));
  out.llama3_pieces.push(pieces(llama3Pattern, text));
}
fs.writeFileSync(outFile, JSON.stringify(out));
console.log(`${texts.length} texts (${corpusTexts} from the corpus) written to ${outFile}`);
