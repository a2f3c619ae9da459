//! `cargo +nightly fuzz run decode_batch` (from agent/): the KV-event decoder never panics, and
//! whatever it accepts re-encodes to a payload that decodes to the same batch.

#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_agent::wire::{EventForm, decode_batch, encode_batch};

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = decode_batch(data) {
        // NaN never equals itself; everything else must survive a round trip.
        if !format!("{batch:?}").contains("NaN") {
            for form in [EventForm::TaggedArray, EventForm::TaggedMap] {
                let again = decode_batch(&encode_batch(&batch, form));
                assert_eq!(again.as_ref(), Ok(&batch), "{form:?}");
            }
        }
    }
});
