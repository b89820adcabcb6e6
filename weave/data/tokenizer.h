#pragma once
// Moved: weave 0.2 placed this header at weave/data/text/tokenizer.h, when data/ gained its rooms
// (text/: the tokenizer and token files; hf/: Hugging Face checkpoints). This one only forwards
// there, for the 0.2 release; it goes away after it. Include the new path, or weave/weave.h.
#include "weave/data/text/tokenizer.h"
