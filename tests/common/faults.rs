//! The fault-injection suite's tally: every case says how many faults it injected, how many the
//! system survived (nothing hung past its deadline, every page intact or reported, no page or
//! ack leaked) and how many bytes were served wrong as a hit (always 0, or the case fails).
//!
//! Each case prints one line, `fault-injection: CASE: injected I, survived S, served wrong W`,
//! which `scripts/fault-injection.sh` sums into the suite's summary line. Run the binaries with
//! `--nocapture` for the lines to show.

/// What one fault-injection case did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Faults injected.
    pub injected: u64,
    /// Faults after which every assertion of the case held.
    pub survived: u64,
    /// Bytes served as a hit that differ from what was stored.
    pub served_wrong: u64,
}

impl Tally {
    /// One more fault injected, and whether it was survived.
    pub fn fault(&mut self, survived: bool) {
        self.injected += 1;
        self.survived += u64::from(survived);
    }

    /// One more fault injected, survived when every named check holds; prints the names of
    /// those that do not, so a failure says what broke.
    pub fn fault_checked(&mut self, checks: &[(&str, bool)]) {
        let failing: Vec<&str> = checks
            .iter()
            .filter(|(_, holds)| !holds)
            .map(|(name, _)| *name)
            .collect();
        if !failing.is_empty() {
            println!("fault-injection: not survived: {}", failing.join(", "));
        }
        self.fault(failing.is_empty());
    }

    /// Prints the case's line, then fails the case unless every fault was survived and no byte
    /// was served wrong.
    pub fn report(self, case: &str) {
        println!(
            "fault-injection: {case}: injected {}, survived {}, served wrong {}",
            self.injected, self.survived, self.served_wrong
        );
        assert!(self.injected > 0, "{case}: no fault was injected");
        assert_eq!(
            self.survived, self.injected,
            "{case}: a fault was not survived"
        );
        assert_eq!(
            self.served_wrong, 0,
            "{case}: bytes were served wrong as a hit"
        );
    }
}
