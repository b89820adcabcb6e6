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

// The patterns' \s is Unicode's White_Space, as in Python's regex module (GPT-2's encoder.py)
// and the Rust tiktoken and tokenizers; JavaScript's \s differs on U+0085 and U+FEFF.
const gpt2Pattern =
    /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;
// Llama 3's (?i:'s|...) spelled out for node's regular expressions, which lack inline flags;
// U+017F (long s) folds to s.
const llama3Pattern = new RegExp(
    "'(?:[sS\u017F]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" +
    "\\p{N}{1,3}| ?[^\\p{White_Space}\\p{L}\\p{N}]+[\\r\\n]*|\\p{White_Space}*[\\r\\n]+|" +
    "\\p{White_Space}+(?!\\P{White_Space})|\\p{White_Space}+", "gu");
const pieces = (pattern, text) => Array.from(text.matchAll(pattern), (m) => m[0]);
// The npm encoders split with JavaScript's \s: a text holding U+0085 or U+FEFF is encoded piece
// by piece, its pieces cut by the White_Space pattern (byte-pair merges never cross pieces).
const jsSplitsDifferently = (text) => /[\u0085\ufeff]/u.test(text);
const byPieces = (encode, text) => pieces(gpt2Pattern, text).flatMap((p) => encode(p));

const out = {corpus_texts: corpusTexts, texts, gpt3: [], r50k: [], r50k_special: [], gpt2_pieces: [], llama3_pieces: []};
for (const text of texts) {
  const differs = jsSplitsDifferently(text);
  out.gpt3.push(differs ? byPieces((p) => gpt3.encode(p), text) : gpt3.encode(text));
  // special tokens' text is ordinary text
  out.r50k.push(differs ? byPieces((p) => r50k.encode(p, [], []), text) : r50k.encode(text, [], []));
  out.r50k_special.push(differs ? byPieces((p) => r50k.encode(p, "all"), text)
                                : r50k.encode(text, "all"));
  out.gpt2_pieces.push(pieces(gpt2Pattern, text));
  out.llama3_pieces.push(pieces(llama3Pattern, text));
}
fs.writeFileSync(outFile, JSON.stringify(out));
console.log(`${texts.length} texts (${corpusTexts} from the corpus) written to ${outFile}`);
