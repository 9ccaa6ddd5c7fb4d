# vgg11 experiment rules (owned by its issue); append final outputs to TARGETS.
