"""What every package of this project shares and none of them owns: the report page and
writer (infra.report_page, infra.report_writer) and the HTTP transport (infra.http). It
imports nothing of ours, so reference_model, kernel_toggles, needle and fidelity can all
use it without an import running back up."""
