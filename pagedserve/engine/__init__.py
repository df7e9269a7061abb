"""The engine: the step loop over the core, and the front end that turns tokens into outputs."""
