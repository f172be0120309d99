"""What runs inside a training pod or container: doeks' torchrun (torch's, patched), its workers and zygote, the hang
watchdog, the launcher, the torch check and the reading of a failed worker's log. Standard library and torch only:
the image stages this package (doeks.trainimage.STAGE_FILES) without the rest of doeks."""
