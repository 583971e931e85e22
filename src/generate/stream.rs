//! Text as tokens arrive: each new token's text is what decoding the tokens so far adds to what
//! was already printed. Decoding the whole run of tokens (not each token alone) keeps
//! multi-byte characters split across byte-level tokens whole, and the spaces that
//! SentencePiece-style decoders put between words; a piece that ends in an incomplete character
//! (U+FFFD) waits for the next token. After a newline the run starts afresh, so each step
//! decodes one line at most, as transformers' TextStreamer does.

use crate::data::TextTokenizer;
use anyhow::Result;

/// The text of a run of tokens as they arrive (see the module docs).
pub struct TextStream<'t> {
    tok: &'t TextTokenizer,
    /// The tokens since the last newline.
    ids: Vec<u32>,
    /// Bytes of their text already given out.
    printed: usize,
}

impl<'t> TextStream<'t> {
    /// A stream that decodes with `tok`.
    pub fn new(tok: &'t TextTokenizer) -> Self {
        TextStream {
            tok,
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// The text `id` adds, if it completes any (special tokens add none).
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        Ok(self.take(text))
    }

    /// Whatever is left (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let text = self.tok.decode(&self.ids)?;
        let out = self.take(text);
        self.ids.clear();
        self.printed = 0;
        Ok(out)
    }

    fn take(&mut self, text: String) -> Option<String> {
        if text.len() <= self.printed || !text.is_char_boundary(self.printed) {
            return None;
        }
        let out = text[self.printed..].to_string();
        if out.ends_with('\n') {
            self.ids.clear();
            self.printed = 0;
        } else {
            self.printed = text.len();
        }
        Some(out)
    }
}
