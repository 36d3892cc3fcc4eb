//! Text corpus, unigram entropy and the batch sampler.

use meshtrain_data::text::{shipped_shakespeare_path, SHAKESPEARE_SHA256};
use meshtrain_data::{unigram_entropy_nats, DataError, TextBatchSampler, TextCorpus};

#[test]
fn unigram_entropy_by_hand() {
    // p = (2/3, 1/3): H = ln 3 - (2/3) ln 2.
    let expected = 3f64.ln() - 2.0 / 3.0 * 2f64.ln();
    assert!((unigram_entropy_nats(b"aab") - expected).abs() < 1e-12);
    assert!((unigram_entropy_nats(b"abcd") - 4f64.ln()).abs() < 1e-12);
    assert_eq!(unigram_entropy_nats(b"zzzz"), 0.0);
    assert_eq!(unigram_entropy_nats(b""), 0.0);
}

#[test]
fn split_is_ninety_ten_and_contiguous() {
    let corpus = TextCorpus::from_bytes((0..=255u8).cycle().take(1005).collect());
    assert_eq!(corpus.train.len(), 904); // floor(1005 * 0.9)
    assert_eq!(corpus.val.len(), 101);
    assert_eq!(corpus.val[0], (904 % 256) as u8);
}

#[test]
fn shipped_shakespeare_loads_verified() {
    let corpus = TextCorpus::shakespeare().unwrap();
    assert_eq!(corpus.train.len() + corpus.val.len(), 1_158_233);
    assert_eq!(corpus.train.len(), 1_042_409);
    assert!(corpus
        .train
        .iter()
        .chain(&corpus.val)
        .all(|&b| b == b'\n' || (0x20..0x7f).contains(&b)));
    assert!(corpus.train.starts_with(b"HAMLET, PRINCE OF DENMARK"));
    // Independent value: Python's collections.Counter over the same bytes.
    let entropy = unigram_entropy_nats(&corpus.val);
    assert!((entropy - 3.361_067_768_851_611).abs() < 1e-9, "{entropy}");
}

#[test]
fn corpus_checksum_mismatch_names_the_file() {
    let path = std::env::temp_dir().join(format!("meshtrain-text-{}.txt", std::process::id()));
    let mut bytes = std::fs::read(shipped_shakespeare_path()).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let error = TextCorpus::load(&path, Some(SHAKESPEARE_SHA256)).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(
        matches!(error, DataError::ChecksumMismatch { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains(&path.display().to_string()));
    let missing = TextCorpus::load(&path, None).unwrap_err();
    assert!(
        matches!(missing, DataError::MissingFile { .. }),
        "{missing:?}"
    );
}

/// Bytes that encode their own position (mod 251), so every window reveals
/// its offset.
fn positional_data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[test]
fn sampler_targets_are_the_next_bytes_and_offsets_match_reference() {
    let (batch, block) = (4, 8);
    let data = positional_data(1000 + block); // 1000 possible starts
    let mut sampler = TextBatchSampler::new(batch, block, 2024).unwrap();
    let mut x = vec![0u32; batch * block];
    let mut y = vec![0u32; batch * block];
    sampler.sample(&data, &mut x, &mut y).unwrap();
    // Starts from the independent Python reference for seed 2024.
    for (row, start) in [622usize, 97, 298, 116].into_iter().enumerate() {
        let expect_x: Vec<u32> = data[start..start + block]
            .iter()
            .map(|&b| b.into())
            .collect();
        let expect_y: Vec<u32> = data[start + 1..start + block + 1]
            .iter()
            .map(|&b| b.into())
            .collect();
        assert_eq!(x[row * block..(row + 1) * block], expect_x[..]);
        assert_eq!(y[row * block..(row + 1) * block], expect_y[..]);
    }
}

#[test]
fn sampler_is_deterministic_and_reaches_both_ends() {
    let block = 5;
    let data = positional_data(block + 20); // starts 0..=19
    let draw = |seed| {
        let mut sampler = TextBatchSampler::new(50, block, seed).unwrap();
        let mut x = vec![0u32; 50 * block];
        let mut y = vec![0u32; 50 * block];
        sampler.sample(&data, &mut x, &mut y).unwrap();
        x
    };
    assert_eq!(draw(1), draw(1));
    assert_ne!(draw(1), draw(2));
    let starts: Vec<u32> = draw(1).chunks(block).map(|row| row[0]).collect();
    assert!(starts.contains(&0) && starts.contains(&19), "{starts:?}");
    assert!(starts.iter().all(|&s| s <= 19));
}

#[test]
fn sampler_rejects_bad_inputs() {
    assert!(TextBatchSampler::new(0, 4, 0).is_err());
    let mut sampler = TextBatchSampler::new(2, 4, 0).unwrap();
    let (mut x, mut y) = (vec![0u32; 8], vec![0u32; 8]);
    let error = sampler.sample(b"abcd", &mut x, &mut y).unwrap_err();
    assert!(
        matches!(error, DataError::TextTooShort { len: 4, needed: 5 }),
        "{error:?}"
    );
    let error = sampler
        .sample(b"abcdefgh", &mut x[..7], &mut y)
        .unwrap_err();
    assert!(
        matches!(error, DataError::BufferSize { what: "inputs", .. }),
        "{error:?}"
    );
}
