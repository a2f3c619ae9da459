//! An HTTP answer's body read up to a bound: a replica's answer is input like any other, and
//! neither its length header nor its length as it comes is trusted. Used for `/tokenize`,
//! `/v1/models` and `/metrics`.
//!
//! Concurrency: none; each read owns its response.

use bytes::{Bytes, BytesMut};

/// Why a body was not read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the answer is over {0} bytes")]
    TooLong(usize),
    #[error(transparent)]
    Http(#[from] reqwest::Error),
}

/// The response's body, up to `max` bytes: a longer one (by its length header or as it comes)
/// is an error before more of it is read.
pub async fn read_capped(mut response: reqwest::Response, max: usize) -> Result<Bytes, BodyError> {
    let declared = response.content_length().unwrap_or(0);
    if declared > max as u64 {
        return Err(BodyError::TooLong(max));
    }
    let mut body = BytesMut::with_capacity(usize::try_from(declared).unwrap_or(0));
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > max {
            return Err(BodyError::TooLong(max));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}
