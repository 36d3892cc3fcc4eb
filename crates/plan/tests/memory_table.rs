//! The memory model against Korthikanti et al. 2022's layouts that ran or ran out of memory
//! (see `meshtrain_plan::memory_validation`): prints every row and the confusion matrix.

use meshtrain_plan::memory_validation::{korthikanti_2022, Confusion, SOURCE};

#[test]
fn published_ran_and_oom_layouts_are_predicted() {
    let cases = korthikanti_2022().unwrap();
    println!("{SOURCE}");
    for c in &cases {
        println!(
            "{:>5} {:<30} {:<45} published {:<4} predicted {:>6.1} GiB {}",
            c.model,
            c.variant,
            c.layout.to_string(),
            if c.ran { "ran" } else { "OOM" },
            c.predicted_gib,
            if c.predicted_fits { "fits" } else { "OOM" },
        );
    }
    let confusion = Confusion::of(&cases);
    println!("{confusion}");
    assert_eq!(confusion.total(), 12);
    assert!(confusion.accuracy() >= 0.95, "{confusion}");
}
