"""One engine step's parts, in the order a step runs them: `scheduler` (admit, chunk, preempt),
`planner` (each sequence's drafting for the step, priced by `adaptive`'s measured costs),
`verifier` (one target forward, rejection sampling), `stopping` (what ends a request).
`specdec.engine` ties them to the proposers (`specdec.draft`) and the models (`specdec.target`)."""
