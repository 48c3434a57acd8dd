"""Inside a rank: the training library a user's script imports (`Session`,
`Generation`), the step boundary, the state agreement at a generation start,
sampling, step and failure reports, checkpoint hooks and the audit records."""
