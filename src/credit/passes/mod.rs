//! The credit passes, one [`CreditPass`] per file, and [`plugin`], which names the one that runs
//! each [`Pass`] of a spec.
pub(crate) mod exact;
pub(crate) mod refeed;
pub(crate) mod replica;
pub(crate) mod spectrum;

use super::pass::CreditPass;
use super::spec::Pass;

/// The plug-in that runs `pass`.
pub(crate) fn plugin(pass: Pass) -> &'static dyn CreditPass {
    match pass {
        Pass::Exact => &exact::Exact,
        Pass::Replica => &replica::Replica,
        Pass::Refeed => &refeed::Refeed { replica: false },
        Pass::RefeedReplica => &refeed::Refeed { replica: true },
        Pass::Spectrum => &spectrum::Spectrum { replica: false },
        Pass::SpectrumReplica => &spectrum::Spectrum { replica: true },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::credit::spec::{PassSchedule, PassSpec};

    /// Every pass name has a plug-in that runs that pass, under the schedule the spec declares
    /// for it; a plug-in registered under the wrong name is told apart.
    #[test]
    fn every_pass_is_registered_under_its_schedule() {
        let passes: PassSpec =
            toml::from_str("run = [\"exact\"]\nbatch_size = 4\nreplica_schedule = \"shuffled\"")
                .expect("pass spec");
        let runs_exact = |p: &dyn CreditPass| {
            let s = p.schedule(&passes, "test", 10).expect("schedule");
            assert_eq!(s.name == "exact", s.key_pad == 0);
            s.name == "exact"
        };
        for pass in Pass::ALL {
            let p = plugin(pass);
            assert_eq!(p.pass(), pass);
            assert_eq!(
                runs_exact(p),
                pass.schedule() == PassSchedule::Exact,
                "{pass}"
            );
        }
        let wrong = refeed::Refeed { replica: true };
        assert_ne!(
            runs_exact(&wrong),
            Pass::Refeed.schedule() == PassSchedule::Exact
        );
    }
}
