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
